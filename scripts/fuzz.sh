#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz; clang, ASan, UBSan) into build-fuzz/ and runs each for
# DURATION seconds, one after another, starting from its seed corpus in tests/fuzz/corpus/<harness>/.
# New inputs go to build-fuzz/corpus/<harness>/ (MERGE=1 merges them into the repository's corpus,
# minimized); crashes to build-fuzz/crashes/. Prints per harness the runs reached and whether it crashed;
# exits non-zero if any did.
#   scripts/fuzz.sh DURATION [harness...]      # e.g. scripts/fuzz.sh 3600; CI: scripts/fuzz.sh 15
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:?usage: scripts/fuzz.sh DURATION [harness...]}
shift
BUILD=${BUILD:-build-fuzz}
harnesses=("$@")
((${#harnesses[@]})) || harnesses=(fuzz_ring_messages fuzz_layout fuzz_control fuzz_peer_wire fuzz_snapshot_file
  fuzz_metrics_http)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only" \
  -DCMAKE_CXX_COMPILER=clang++ \
  -DTRAINSTREAM_FUZZ=ON -DTRAINSTREAM_BUILD_TESTS=OFF -DTRAINSTREAM_BUILD_PYTHON=OFF \
  -DTRAINSTREAM_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target "${harnesses[@]}"
# gRPC and protobuf are not instrumented, and keep some allocations for the process's life on purpose.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
printf '%-20s %12s %8s  %s\n' harness runs seconds result
for h in "${harnesses[@]}"; do
  work="$BUILD/corpus/$h" crashes="$BUILD/crashes/$h/"
  mkdir -p "$work" "$crashes"
  log="$BUILD/$h.log"
  if "$BUILD/tests/fuzz/$h" -max_total_time="$DURATION" -timeout=30 -rss_limit_mb=4096 -max_len=4096 -artifact_prefix="$crashes" \
      -print_final_stats=1 "$work" "tests/fuzz/corpus/$h" >"$log" 2>&1; then
    result=ok
  else
    result="CRASH (see $log, inputs in $crashes)"
    status=1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  printf '%-20s %12s %8s  %s\n' "$h" "$runs" "$DURATION" "$result"
  if [[ ${MERGE:-0} == 1 ]]; then
    "$BUILD/tests/fuzz/$h" -merge=1 "tests/fuzz/corpus/$h" "$work" >>"$log" 2>&1
  fi
done
exit $status
