#!/usr/bin/env bash
# Builds trainstream on the GPU machine and runs the chosen stages, writing logs and JSON under $OUT.
# Carry `.device` (holding sysroot.tgz, see ../shared/device/README.md) with the device tool. The
# daemon's metrics need prometheus-cpp in it, which the sysroot script leaves out by default:
#   EXTRA_PKGS="prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libcivetweb1" \
#     ../shared/device/make-sysroot.sh /tmp/sr/sysroot && tar -C /tmp/sr -czf .device/sysroot.tgz sysroot
#   scripts/device_run.sh build test bench-adamw gpt-small gpt-large
# TRAINSTREAM_TRANSPORT=cuda-client-copy runs the GPU stages through the fallback transport (the
# default is cuda-ipc); the gpt stages name their JSON after it. The torchao stage installs the
# reference offloader from a wheel in .device (the machine has no network):
#   pip download torchao --no-deps -d .device
#
# trainstream from a wheel instead of a build: carry a cp312 wheel in .device/trainstream/ (git-ignored, as
# all of .device; about 6 MB of carry's 64 MiB, beside sysroot.tgz's 14 MB):
#   scripts/build_wheels.sh --python 3.12 --no-sdist --out .device/trainstream
#   device run, carry [".device"]:  scripts/device_run.sh wheel-info test-cuda gpt-large
# The wheel goes into a fresh venv, /tmp/ts-venv, that sees the machine's torch and the other packages of
# its python3 through a .pth file. No sysroot is on any path and TRAINSTREAMD is unset: connect() starts
# the wheel's trainstreamd, the tests' conftest finds it and its trainstreamctl the same way. Stages that
# compile or use a build's binaries (build, build-fast, build-before, use-bin, python-before) switch the
# rest of the run to this tree's build and the sysroot (use_sysroot), as without a wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
VENV=/tmp/ts-venv

# The sysroot's libraries for the compiler and this tree's build (its daemon, its Python package) for
# everything after: once per run.
use_sysroot() {
  [[ -n ${TS_SYSROOT:-} ]] && return
  if [[ ! -d .device/sysroot ]]; then tar -C .device -xzf .device/sysroot.tgz; fi
  export TS_SYSROOT=$PWD/.device/sysroot/usr
  export PATH=$TS_SYSROOT/bin:${PATH//$VENV\/bin:/} LD_LIBRARY_PATH=$TS_SYSROOT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  export PKG_CONFIG_PATH=$TS_SYSROOT/lib/x86_64-linux-gnu/pkgconfig
  export TRAINSTREAMD=$PWD/build/daemon/trainstreamd PYTHONPATH=$PWD/python:/tmp/site
}

# The carried wheel $1 installed into $VENV (again only when the wheel changed), first on PATH.
use_wheel() {
  if [[ ! -x $VENV/bin/trainstreamd ]] || [[ $(cat "$VENV/installed-wheel" 2>/dev/null) != "$(sha256sum <"$1")" ]]; then
    local machine_site venv_site
    machine_site=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    rm -rf "$VENV"
    if python3 -m venv "$VENV" 2>/dev/null; then
      "$VENV/bin/python" -m pip install -q --no-index --no-deps "$1" 2>&1 | tail -2
    else  # a python3 without ensurepip: the machine's pip installs into the venv
      python3 -m venv --without-pip "$VENV" && python3 -m pip --python "$VENV/bin/python" install -q --no-index \
        --no-deps "$1" 2>&1 | tail -2
    fi
    venv_site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    echo "$machine_site" >"$venv_site/machine-site-packages.pth"  # after the venv's own: its trainstream wins
    sha256sum <"$1" >"$VENV/installed-wheel"
  fi
  export PATH=$VENV/bin:$PATH PYTHONPATH=/tmp/site
  unset TRAINSTREAMD
}

wheel=$(ls .device/trainstream/trainstream-*-cp312-*.whl 2>/dev/null | tail -1)
if [[ -n $wheel ]]; then use_wheel "$wheel"; else use_sysroot; fi

stage() { echo "=== $1 ($(date +%T))"; }

# Peers from wheels carried in .whl (torchao, DeepSpeed and what DeepSpeed needs), once per machine.
install_wheels() {
  [[ -d /tmp/site ]] && return
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
}

# The host's memory bandwidth the bounds use: the STREAM triad of the machine's benchmarks/adamw result.
triad_gbs() {
  python3 -c "import json; print(json.load(open('benchmarks/results/adamw_h200-16core.json'))['triad']['gb_per_s'])"
}

# One line of a train_gpt JSON's first run: its step, phases, busy cores, median waits on the daemon, the
# neighbor beside it (gpt-beside), its GPU phases (--gpu-phases) and the daemon's running workers and idle
# milliseconds in each (--daemon-busy).
brief() {
  python3 -c "import json, statistics, sys; r = json.load(open(sys.argv[1]))['runs'][0]; \
    print(r['mode'], r.get('error') or f\"{r['step_ms']:.1f} ms\", {k: round(v, 1) for k, v in r.get('phases_ms', {}).items()}, \
    {k: round(v, 2) for k, v in r.get('busy_cores', {}).items()}, \
    'weights wait', round(statistics.median(r.get('weights_wait_ms') or [0]), 1), \
    'region wait', round(statistics.median(r.get('region_wait_ms') or [0]), 2), \
    'wanted wait', round(statistics.median(r.get('wanted_wait_ms') or [0]), 2), r.get('beside', ''), \
    {k: round(v, 1) for k, v in r.get('gpu_phases_ms', {}).items()}, \
    *[{k: round(v, 1) for k, v in r['daemon_busy'][part].items()} for part in \
      (('cores_by_gpu_phase', 'idle_ms_by_gpu_phase') if 'daemon_busy' in r else ())])" "$1"
}

# The 124M's forced offload for STEPS (40) steps into JSON $1, quietly, then its brief line labelled $2;
# further arguments go to train_gpt, and environment assignments before the call reach it (TRAINER_WRAP: a
# command the trainer runs under, e.g. taskset).
small_offload() {
  local json=$1 label=$2 && shift 2
  timeout 120 ${TRAINER_WRAP:-} python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes trainstream --steps "${STEPS:-40}" \
    --adamw-json benchmarks/results/adamw_h200-16core.json --json "$json" "$@" >/dev/null 2>&1
  brief "$json" | sed "s|^|[$label] |"
}

# small_offload of a named variant (JSON $1, variant $2, label $3, further arguments to train_gpt): "per-module*"
# under /tmp/before's Python (python-per-module), "*probe*" with the split probe (--probe-detached-lookup),
# "*idle" with the daemon's workers at SCHED_IDLE.
variant_offload() {
  local json=$1 variant=$2 label=$3 && shift 3
  local python=$PWD/python extra=()
  [[ $variant == per-module* ]] && python=/tmp/before/python
  [[ $variant == *probe* ]] && extra+=(--probe-detached-lookup)
  [[ $variant == *idle ]] && extra+=(--daemon-policy idle)
  PYTHONPATH=$python:/tmp/site small_offload "$json" "$label" "$@" "${extra[@]}"
}

# The 124M's forced offload under each value of environment variable $1 (the values $2) in turn,
# alternated RUNS (2) times, each run its own process and JSON: gpt_124m_$3<value>_run<n>.json.
alternated() {
  local variable=$1 values=$2 prefix=$3 run value
  for run in $(seq "${RUNS:-2}"); do
    for value in $values; do
      (export "$variable=$value" && small_offload "$OUT/gpt_124m_$prefix${value}_run$run.json" "$variable=$value, run $run")
    done
  done
}

for what in "$@"; do
  case $what in
    build-fast)
      use_sysroot
      stage build-fast  # Release, the daemon, the module and the GPU-facing benchmarks only; binaries to $OUT
      { nproc; free -g; df -h /dev/shm; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
        >"$OUT/machine.txt" 2>&1
      mount -o remount,size=120G /dev/shm 2>/dev/null || true
      cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TS_SYSROOT" -DTRAINSTREAM_BUILD_TESTS=OFF \
        -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" \
        >"$OUT/build.log" 2>&1 && cmake --build build -j"${BUILD_JOBS:-16}" --target trainstreamd _C ts_bench_adamw \
        >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      mkdir -p "$OUT/bin" && cp build/daemon/trainstreamd python/trainstream/_C*.so build/benchmarks/adamw/ts_bench_adamw \
        "$OUT/bin/" && strip "$OUT/bin/trainstreamd" "$OUT/bin/ts_bench_adamw" "$OUT"/bin/_C*.so
      ;;
    lora)
      stage lora  # LoRA r=16 on Qwen2.5-shaped bases bigger than the cap: trainstream beside the stock Trainer
      # (GPU-only uncapped, accelerate's CPU offload, DeepSpeed ZeRO-3: LORA_MODES), each mode its own process
      # within LORA_MODE_TIMEOUT seconds (N, or N,MODE=N,...); one shape per device call fits its 10 minutes
      install_wheels
      for spec in ${LORA_SHAPES:-14b:8 32b:12}; do
        shape=${spec%%:*} cap=${spec##*:}
        timeout "${LORA_TIMEOUT:-540}" python3 benchmarks/lora/lora_bench.py --shape "$shape" --vram-cap-gib "$cap" \
          --modes "${LORA_MODES:-trainstream,gpu-only,accelerate}" --mode-timeout "${LORA_MODE_TIMEOUT:-150}" \
          --steps ${STEPS:-4} --warmup ${WARMUP:-2} --json "$OUT/lora_${shape}_cap${cap}.json" 2>&1 | tail -1
      done
      ;;
    hf-full)
      stage hf-full  # the Qwen2.5-1.5B shape fully fine-tuned through TrainstreamTrainer under a 24 GiB cap,
      # beside the stock Trainer under the cap (out of memory there on 2026-12-01: its error is recorded; it fit on
      # 2026-12-02) and uncapped
      timeout "${HF_FULL_TIMEOUT:-300}" python3 examples/hf_finetune.py --shape "${HF_SHAPE:-1.5b}" --cap-gib "${HF_CAP:-24}" \
        --steps ${HF_STEPS:-8} --compare-stock ${HF_ARGS:-} \
        --host-gbs "$(triad_gbs)" \
        --json "$OUT/hf_full_${HF_SHAPE:-1.5b}_cap${HF_CAP:-24}.json" 2>&1 | grep -v "^step \|it/s\]" | tail -6
      if [[ -n ${HF_PROFILE:-} ]]; then  # trainstream alone, a timeline of its last two of six steps
        timeout 120 python3 examples/hf_finetune.py --shape "${HF_SHAPE:-1.5b}" --cap-gib "${HF_CAP:-24}" --steps 6 \
          --profile "$OUT/trace_hf_${HF_SHAPE:-1.5b}.json" >/dev/null 2>&1; gzip -f "$OUT/trace_hf_${HF_SHAPE:-1.5b}.json"
      fi
      ;;
    hf-paged)
      stage hf-paged  # a full fine-tune of HF_SHAPE (the Qwen2.5-7B shape) through TrainstreamTrainer, its layers
      # paged, under HF_CAP GiB (24), bf16 moments, checkpointed layers; initialized on the GPU, then moved
      timeout "${HF_PAGED_TIMEOUT:-240}" python3 examples/hf_finetune.py --shape "${HF_SHAPE:-7b}" --paged --init-on-gpu \
        --cap-gib "${HF_CAP:-24}" --steps ${HF_STEPS:-6} --moment-dtype bfloat16 --gradient-checkpointing \
        --host-gbs "$(triad_gbs)" \
        --json "$OUT/hf_paged_${HF_SHAPE:-7b}_cap${HF_CAP:-24}.json" 2>&1 | grep -v "^step \|it/s\]" | tail -4
      free -g | head -2
      ;;
    gpt-auto)
      stage gpt-auto  # the 124M GPT: stock fused AdamW, offload="auto", forced offload (40 steps: medians of 8
      # differed by 10% between the GPU-only mode and stock on 2026-12-02, more than auto's 1.05x target)
      timeout 200 python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes stock,auto,gpu-only,trainstream --steps 40 \
        --adamw-json benchmarks/results/adamw_h200-16core.json --json "$OUT/gpt_124m_auto.json" 2>&1 | tail -1
      ;;
    clipping)
      stage clipping  # the redo rate over 200+ steps of the 124M (REDO_STEPS=0 skips it); the 1.86B clipped against unclipped, fp32 and bf16 weights
      [[ ${REDO_STEPS:-220} != 0 ]] && timeout 150 python3 benchmarks/clipping/redo_rate.py --device cuda \
        --steps ${REDO_STEPS:-220} --json "$OUT/clipping_redo_rate_124m.json" 2>&1 | tail -4
      for weights in ${CLIP_WEIGHTS:-fp32 bf16}; do
        flags=""; [[ $weights == bf16 ]] && flags="--bf16-weights --moment-dtype bfloat16"
        for norm in none 1.0; do
          clip=""; [[ $norm != none ]] && clip="--max-grad-norm $norm"
          timeout 120 python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --vram-cap-gib 24 --steps ${STEPS:-6} \
            --warmup 2 --modes trainstream $flags $clip --adamw-json benchmarks/results/adamw_h200-16core.json \
            --json "$OUT/gpt_1.86b_cap24_${weights}_clip$norm.json" 2>&1 | tail -1 | sed "s|^|[$weights clip $norm] |"
        done
      done
      ;;
    populate)
      stage populate  # how fast the kernel backs shared memory: one file or many, 4 KiB or huge pages (fast start)
      (cd benchmarks/transfer && timeout 90 python3 populate.py --gib ${POPULATE_GIB:-4} --threads 1,4,16 \
        --json "$OUT/populate.json" 2>&1 | tail -16)
      ;;
    shm-huge=*)
      stage "$what"  # /dev/shm's huge page policy: never, advise (the segments ask: shm/segment.cpp), within_size
      mount -o remount,huge=${what#shm-huge=} /dev/shm && grep /dev/shm /proc/mounts
      ;;
    seed-copy)
      stage seed-copy  # where a new job's seed goes: the trainer's first touch of the master weights' pages, the
      # GPU copies, the CPU copies (benchmarks/transfer/seed_copy.py)
      (cd benchmarks/transfer && timeout 120 python3 seed_copy.py --gib "${SEED_GIB:-7}" --json "$OUT/seed_copy.json" 2>&1 | tail -4)
      ;;
    gpt-start)
      stage gpt-start  # wrap() to the end of the first step of START_CONFIG (the 1.86B; fp32 weights unless
      # START_ARGS say otherwise; two steps), under this shm policy: how long a private daemon takes to serve,
      # then the run against a daemon logging at info (its log says how long backing the state took, and
      # page-locking ahead), whose log comes back; each run of the stage its own JSON and log (run1, run2, ...).
      # START_DAEMON: another trainstreamd (a build of other sources, .device/bin's), START_PYTHON another
      # trainstream package's folder (python-before's /tmp/before/python), START_LABEL names their runs
      policy=$(grep -o 'huge=[a-z_]*' <(grep /dev/shm /proc/mounts) || echo huge=never) && policy=${policy#huge=}
      policy=$policy${START_LABEL:+_$START_LABEL}
      config=${START_CONFIG:-1.86b}
      run=1 && while [[ -e "$OUT/gpt_${config}_start_${policy}_run$run.json" ]]; do run=$((run + 1)); done
      policy=${policy}_run$run
      python3 -c "import time; from trainstream._connect import PrivateDaemon as P; t = time.perf_counter(); d = P(); \
        print(f'private daemon serving after {time.perf_counter() - t:.2f} s'); d.stop()"
      socket=/tmp/ts-start.sock && rm -f $socket
      ${START_DAEMON:-build/daemon/trainstreamd} --socket $socket --log-level info >"$OUT/daemon_start_$policy.log" 2>&1 & daemon=$!
      for _ in $(seq 200); do [[ -S $socket ]] && break; sleep 0.05; done
      TRAINSTREAM_ADDRESS=unix:$socket PYTHONPATH=${START_PYTHON:-$PWD/python}:/tmp/site \
        timeout 180 python3 benchmarks/train_gpt/train_gpt.py --config "$config" \
        --vram-cap-gib 24 --steps 2 --warmup 1 --modes trainstream ${START_ARGS:-} \
        --adamw-json benchmarks/results/adamw_h200-16core.json \
        --json "$OUT/gpt_${config}_start_$policy.json" 2>&1 | tail -1 | sed "s|^|[$policy] |"
      kill $daemon; wait $daemon; grep -h "created\|page-locked ahead" "$OUT/daemon_start_$policy.log"
      ;;
    gpt-start-floor)
      stage gpt-start-floor  # the GPU-only first step of START_CONFIG (1.86b; forward + backward, no optimizer, not
      # capped): the model's own warm-up (kernels loaded, the allocator grown), under gpt-start's first step
      config=${START_CONFIG:-1.86b} && json="$OUT/gpt_${config}_gpu-only_first-step.json"
      timeout 180 python3 benchmarks/train_gpt/train_gpt.py --config "$config" --vram-cap-gib 24 --uncapped-reference \
        --steps 2 --warmup 1 --modes gpu-only --json "$json" >/dev/null 2>&1
      python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['runs'][0]; print(r.get('error') or \
        (round(r['first_step_seconds'], 2), {k: round(v) for k, v in r['first_step_phases_ms'].items()}))" "$json"
      ;;
    gpt-peers)
      stage gpt-peers  # the 1.86B, bf16 weights and moments, clipped at 1.0, 24 GiB cap: trainstream beside DeepSpeed ZeRO-2/3
      install_wheels
      timeout "${PEERS_TIMEOUT:-300}" python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --vram-cap-gib 24 \
        --steps ${STEPS:-4} --warmup 2 --bf16-weights --moment-dtype bfloat16 --max-grad-norm 1.0 \
        --modes "${GPT_MODES:-trainstream,deepspeed-zero2,deepspeed-zero3}" --adamw-json benchmarks/results/adamw_h200-16core.json \
        --json "$OUT/gpt_1.86b_cap24_bf16_clip1.0_peers.json" 2>&1 | tail -1
      ;;
    gpt-threads)
      stage gpt-threads  # the 124M's forced offload against the daemon's worker threads and their nice value
      # (THREAD_RUNS: threads:nice ..., "default" for the daemon's), each step's phases as the trainer saw
      # them; the GPU-only step beside
      timeout 90 python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes gpu-only --steps 40 \
        --json "$OUT/gpt_124m_gpu-only.json" >/dev/null 2>&1; brief "$OUT/gpt_124m_gpu-only.json"
      for run in ${THREAD_RUNS:-16:0 14:0 12:0 16:10}; do
        threads=${run%%:*} nice=${run##*:} json="$OUT/gpt_124m_threads${run%%:*}_nice${run##*:}.json"
        flags=""; [[ $nice != default ]] && flags="--daemon-nice $nice"
        timeout 90 python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes trainstream --steps 40 \
          --daemon-threads "$threads" $flags --adamw-json benchmarks/results/adamw_h200-16core.json \
          --json "$json" >/dev/null 2>&1; brief "$json" | sed "s|^|[$threads threads, nice $nice] |"
      done
      ;;
    gpt-small-peers)
      stage gpt-small-peers  # the 124M's forced offload beside the GPU-only step, torchao and DeepSpeed ZeRO-2/3, one invocation
      install_wheels
      timeout "${PEERS_TIMEOUT:-400}" python3 benchmarks/train_gpt/train_gpt.py --config 124m --steps ${STEPS:-40} \
        --modes "${GPT_MODES:-gpu-only,trainstream,torchao,deepspeed-zero2,deepspeed-zero3}" \
        --adamw-json benchmarks/results/adamw_h200-16core.json --json "$OUT/gpt_124m_peers.json" 2>&1 | tail -8
      ;;
    gpt-small-ab)
      stage gpt-small-ab  # the 124M's forced offload, alternated RUNS times, each run its own process and JSON:
      # "before" all of .device/before.tar (build-before, or python-before for a change of the Python alone),
      # "daemon" this tree's daemon under before's Python (the daemon's changes alone), "after" all of this
      # tree; AB_NAMES chooses among them
      for run in $(seq "${RUNS:-2}"); do
        for name in ${AB_NAMES:-before daemon after}; do
          daemon=$PWD python=/tmp/before/python
          [[ $name == before ]] && daemon=/tmp/before
          [[ $name == after ]] && python=$PWD/python
          TRAINSTREAMD=$daemon/build/daemon/trainstreamd PYTHONPATH=$python:/tmp/site small_offload "$OUT/gpt_124m_${name}_run$run.json" \
            "$name $run"
        done
      done
      ;;
    gpt-gpu-waits)
      stage gpt-gpu-waits  # the 124M's forced offload with the forward's weights waited for on the host
      # (TRAINSTREAM_GPU_WAITS=0) and on the GPU (=1), alternated RUNS times, each run its own process and JSON
      alternated TRAINSTREAM_GPU_WAITS "0 1" gpu-waits
      ;;
    gpt-small-hooks)
      stage gpt-small-hooks  # the 124M's forced offload with trainstream's hooks timed on the trainer's thread
      # (benchmarks/train_gpt/hook_times.py: no profiler, whose Python tracing inflates every call)
      small_offload "$OUT/gpt_124m_hook-times.json" "hooks timed" --hook-times
      python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['runs'][0]; \
        [print(f'  {k}: {v}') for k, v in r.get('hooks_per_step', {}).items()]" "$OUT/gpt_124m_hook-times.json"
      ;;
    gpt-small-transports)
      stage gpt-small-transports  # the 124M's forced offload through cuda-ipc (the daemon's copies, from its own
      # CUDA context) and cuda-client-copy (the trainer's copies, from its context), alternated RUNS times
      alternated TRAINSTREAM_TRANSPORT "cuda-ipc cuda-client-copy" ""
      ;;
    launch-queue)
      stage launch-queue  # how many launches a stream takes behind an unmet GPU wait before the thread blocks,
      # and the 124M's forward and backward on the trainer's clock behind a 10 ms wait
      timeout 120 python3 benchmarks/transfer/launch_queue.py --json "$OUT/launch_queue.json" 2>&1 | tail -30
      ;;
    gpt-small-placement)
      stage gpt-small-placement  # the 124M's forced offload with the daemon's workers anywhere, with RESERVED
      # (1 2) of its physical cores kept free of workers (--reserved-cores), and with the trainer on the first
      # two cores (with their hyperthread siblings) and the whole daemon on the others; alternated RUNS times.
      # Whether a busy worker on the trainer's core or its sibling slows its launches
      lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name)" && lscpu -e | head -20
      trainer=$(cat /sys/devices/system/cpu/cpu{0,1}/topology/thread_siblings_list | paste -sd,)
      daemon=$(python3 -c "import os, sys; t = {int(c) for part in sys.argv[1].split(',') for c in \
        (range(int(part.split('-')[0]), int(part.split('-')[-1]) + 1))}; \
        print(','.join(str(c) for c in sorted(os.sched_getaffinity(0) - t)))" "$trainer")
      printf '#!/bin/sh\nexec taskset -c %s %s "$@"\n' "$daemon" "$PWD/build/daemon/trainstreamd" >/tmp/ts-placed && chmod +x /tmp/ts-placed
      echo "split: trainer on $trainer, daemon on $daemon"
      for n in ${RESERVED:-1 2}; do
        printf '#!/bin/sh\nexec %s "$@" --reserved-cores %s\n' "$PWD/build/daemon/trainstreamd" "$n" >/tmp/ts-reserved$n
        chmod +x /tmp/ts-reserved$n
      done
      for run in $(seq "${RUNS:-2}"); do
        small_offload "$OUT/gpt_124m_placement-anywhere_run$run.json" "anywhere, run $run"
        for n in ${RESERVED:-1 2}; do
          TRAINSTREAMD=/tmp/ts-reserved$n small_offload "$OUT/gpt_124m_placement-reserved${n}_run$run.json" "$n cores reserved, run $run"
        done
        TRAINSTREAMD=/tmp/ts-placed TRAINER_WRAP="taskset -c $trainer" \
          small_offload "$OUT/gpt_124m_placement-split_run$run.json" "split, run $run"
      done
      ;;
    gpt-small-slots)
      stage gpt-small-slots  # the 124M's forced offload with SLOT_COUNTS staging slots, alternated RUNS times (the
      # trainer's backward waited 1-8 ms a step for a free one with 4 on 2026-12-02, 6.9 ms on 2026-12-05)
      alternated TRAINSTREAM_STAGING_SLOTS "${SLOT_COUNTS:-4 8 16}" slots
      ;;
    gpt-small-kernels)
      stage gpt-small-kernels  # the 124M's forced offload with the daemon's AdamW kernel forced to each of KERNELS,
      # alternated RUNS times: whether its AVX-512 code on 10 busy cores slows the trainer's thread (torch's calls
      # ran 1.5-2x slower per call beside the daemon on 2026-12-05; keeping the trainer's core free did not help)
      alternated TRAINSTREAM_KERNEL "${KERNELS:-avx512bf16 avx2}" kernel
      ;;
    gpt-beside)
      stage gpt-beside  # the 124M's GPU-only step (no optimizer, no daemon) alone and beside a neighbor process
      # (benchmarks/train_gpt/neighbor.py) of each of NEIGHBORS (triad:N, compute:N, adamw:N, copies:N): whether
      # streaming host memory, busy cores or another context's copies slow the trainer's thread as the daemon
      # does (it replaces gpt-contended, which looped ts_bench_adamw beside the step)
      for spec in ${NEIGHBORS:-none adamw:16 triad:8 compute:12 copies:11}; do
        json="$OUT/gpt_124m_gpu-only_beside-${spec/:/}.json" && flags="" && [[ $spec != none ]] && flags="--beside $spec"
        timeout 120 python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes gpu-only --steps 40 $flags \
          --json "$json" >/dev/null 2>&1; brief "$json" | sed "s|^|[beside $spec] |"
      done
      ;;
    gpt-gpu-phases)
      stage gpt-gpu-phases  # the 124M's GPU-only step and forced offload with each phase on the GPU's clock too
      # (train_gpt --gpu-phases), alternated RUNS (2) times: how long the forward's kernels wait on the GPU for
      # the tied embedding's update (the trainer's threads sat idle 8-12 ms a step where no timer looked, 2026-12-06)
      for run in $(seq "${RUNS:-2}"); do
        for mode in gpu-only trainstream; do
          json="$OUT/gpt_124m_gpu-phases_${mode}_run$run.json"
          timeout 120 python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes $mode --steps 40 --gpu-phases \
            --adamw-json benchmarks/results/adamw_h200-16core.json --json "$json" >/dev/null 2>&1
          brief "$json" | sed "s|^|[run $run] |"
        done
      done
      ;;
    gpt-daemon-busy)
      stage gpt-daemon-busy  # the 124M's forced offload RUNS (2) times with the daemon's running workers sampled every
      # 0.5 ms against the step's GPU phases (train_gpt --daemon-busy): where in a step the daemon, its limit on
      # H100s with slower host memory, has nothing to do
      for run in $(seq "${RUNS:-2}"); do
        small_offload "$OUT/gpt_124m_daemon-busy_run$run.json" "run $run" --daemon-busy
      done
      ;;
    adamw-beside-copies)
      stage adamw-beside-copies  # the daemon's AdamW for fp32 weights (out of place, no upload: the 124M's update)
      # alone and beside another CUDA context copying N GB/s each way between the GPU and pinned host memory
      # (neighbor.py copies), as the daemon's pulls and pushes do during a step: whether they share host memory
      for gbs in 0 14 28 55 0; do
        out=/tmp/copies_$gbs.out && rm -f "$out"
        if ((gbs)); then
          python3 benchmarks/train_gpt/neighbor.py copies $gbs >"$out" & copier=$!
          until grep -q ready "$out" 2>/dev/null; do sleep 0.2; done
        fi
        {
          echo "beside copies of $gbs GB/s each way:"
          build/benchmarks/adamw/ts_bench_adamw --threads 16 --params 100e6 \
            --only "fp32 grad, fp32 moments, no upload, other half" 2>&1 | grep -i "gb/s\|other half" | tail -2
        } | tee -a "$OUT/adamw_beside_copies.log"
        if ((gbs)); then kill -TERM $copier && wait $copier; tail -1 "$out" | tee -a "$OUT/adamw_beside_copies.log"; fi
      done
      ;;
    gpt-small-buckets)
      stage gpt-small-buckets  # the 124M's forced offload with buckets of each size in BUCKET_MBS (8 16 32 64 MiB),
      # alternated RUNS (2) times, the daemon sampled: how the bucket size moves backward's lead-in (its first
      # bucket staged and pulled whole) and the pushes' tail (the last bucket pushed whole)
      for run in $(seq "${RUNS:-2}"); do
        for mb in ${BUCKET_MBS:-8 16 32 64}; do
          small_offload "$OUT/gpt_124m_bucket${mb}mb_run$run.json" "bucket $mb MiB, run $run" --bucket-mb "$mb" \
            --daemon-busy
        done
      done
      ;;
    gpt-split-probe)
      stage gpt-split-probe  # the 124M's forced offload, RUNS (2) times each, with the daemon sampled (--daemon-busy):
      # main; the probe whose token lookup reads the tied embedding detached (its gradient is the output
      # projection's alone, in early in backward: the most the tied split could gain); and both again under the
      # Python of /tmp/before (python-per-module first: this tree's Python with each module's wait in its pre-hook);
      # PROBE_VARIANTS chooses among the four
      for run in $(seq "${RUNS:-2}"); do
        for variant in ${PROBE_VARIANTS:-main probe per-module per-module-probe}; do
          variant_offload "$OUT/gpt_124m_split-probe_${variant}_run$run.json" "$variant" "$variant $run" --daemon-busy
        done
      done
      ;;
    gpt-trace)
      stage gpt-trace  # the 124M's forced offload RUNS (2) times with the daemon's step trace (train_gpt --daemon-trace
      # --gpu-phases): each bucket's pulls, update blocks and pushes on the GPU phases' clock, to tell whether the
      # update runs slower inside the step than alone or its threads wait between pieces; TRACE_VARIANTS adds the
      # split probe (probe) and the waits module by module (per-module*, python-per-module first), as gpt-split-probe, and
      # the workers at SCHED_IDLE (a variant ending in idle: trainstreamd --worker-policy idle)
      for run in $(seq "${RUNS:-2}"); do
        for variant in ${TRACE_VARIANTS:-main}; do
          json="$OUT/gpt_124m_trace_${variant}_run$run.json"
          variant_offload "$json" "$variant" "$variant $run" --daemon-trace --gpu-phases
          python3 -c "import json, sys; sys.path.insert(0, 'benchmarks/train_gpt'); import daemon_trace; \
            r = json.load(open(sys.argv[1]))['runs'][0]; \
            print(sys.argv[2], r.get('error') or f\"{r['step_ms']:.1f} ms\", daemon_trace.summary(r.get('daemon_trace', {})))" \
            "$json" "[$variant $run]"
        done
      done
      ;;
    tied-rows)
      stage tied-rows  # the 124M's tied embedding gradient in its two parts (benchmarks/train_gpt/tied_rows.py): exact
      # or not on this GPU, when the projection's part is in, what the lookup's costs; 8x512 tokens take torch's
      # sorted embedding backward, 2x512 its other kernel (up to 3072 tokens)
      for batch in 8 2; do
        timeout 180 python3 benchmarks/train_gpt/tied_rows.py --device cuda --batch "$batch" \
          --json "$OUT/tied_rows_124m_batch$batch.json" 2>&1 | tail -2
      done
      ;;
    gpt-halves)
      stage gpt-halves  # forced offload of the 124M with one and two state halves (58.6 ms on 2026-12-02, 46.7 ms a day earlier)
      for halves in 1 2; do
        timeout 120 python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes trainstream --steps 40 --state-halves $halves \
          --adamw-json benchmarks/results/adamw_h200-16core.json --json "$OUT/gpt_124m_halves$halves.json" 2>&1 | tail -1 \
          | sed "s|^|[$halves halves] |"
      done
      ;;
    pack)
      stage pack  # what is under $OUT so far in one file, results-N.tgz (the device tool returns at most 8 files);
      # build-fast's bin/ stays as it is, to be carried back in .device/bin (use-bin)
      (cd "$OUT" && n=$(find . -maxdepth 1 -name 'results-*.tgz' | wc -l) \
        && tar -czf /tmp/results.tgz --exclude='./results-*.tgz' --exclude=./bin . \
        && find . -mindepth 1 -maxdepth 1 ! -name 'results-*.tgz' ! -name bin -exec rm -rf {} + \
        && mv /tmp/results.tgz "results-$n.tgz")
      ls -la "$OUT"
      ;;
    gpt-profile)
      stage gpt-profile  # torch.profiler over 20 steps of the 124M in each of PROFILE_MODES, no Python stacks: each
      # op's CPU time on the trainer's threads (trace_124m_<mode>_ops.txt) and the timeline (gzipped)
      for mode in ${PROFILE_MODES:-gpu-only trainstream}; do
        timeout 120 python3 benchmarks/train_gpt/train_gpt.py --config 124m --modes "$mode" --steps 20 \
          --profile "$OUT/trace_124m_$mode.json" --json "$OUT/gpt_124m_profiled_$mode.json" >/dev/null 2>&1
        gzip -f "$OUT/trace_124m_$mode.json"; echo "[$mode]"; head -25 "$OUT/trace_124m_${mode}_ops.txt"
      done
      ;;
    use-bin)
      use_sysroot
      stage use-bin  # binaries a build-fast of the same sources returned earlier, carried in .device/bin
      mkdir -p build/daemon build/benchmarks/adamw && cp .device/bin/trainstreamd build/daemon/ \
        && cp .device/bin/ts_bench_adamw build/benchmarks/adamw/ && cp .device/bin/_C*.so python/trainstream/
      ;;
    build-before)
      use_sysroot
      stage build-before  # the commit in .device/before.tar (a source tarball) built alike, into /tmp/before
      rm -rf /tmp/before && mkdir -p /tmp/before && tar -C /tmp/before -xf .device/before.tar
      (cd /tmp/before && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TS_SYSROOT" \
        -DTRAINSTREAM_BUILD_TESTS=OFF -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
        -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/build_before.log" 2>&1 \
        && cmake --build build -j"${BUILD_JOBS:-16}" --target trainstreamd _C ts_bench_adamw >>"$OUT/build_before.log" 2>&1) \
        || { tail -20 "$OUT/build_before.log"; exit 1; }
      ;;
    python-per-module)
      stage python-per-module  # this tree's Python with each module's wait queued by its own pre-hook (the GPU branch
      # of Rank.take_published cut out) in /tmp/before/python, for the per-module variants of gpt-split-probe and
      # gpt-trace: made from the tree, where a hand-made .device/before.tar went stale (2026-12-06, fifth session)
      rm -rf /tmp/before && mkdir -p /tmp/before && cp -r python /tmp/before/ && python3 - /tmp/before/python/trainstream/_rank.py <<'CUT'
import sys
path = sys.argv[1]
text = open(path).read()
start = text.index("        if self.transport.waits_on_gpu:\n")
end = text.index("            return\n", start) + len("            return\n")
open(path, "w").write(text[:start] + text[end:])
CUT
      ;;
    python-before)
      use_sysroot
      stage python-before  # the Python of .device/before.tar over this tree's binaries (use-bin or build-fast
      # first), in /tmp/before as build-before leaves it: for gpt-small-ab when only the Python changed
      rm -rf /tmp/before && mkdir -p /tmp/before/build/daemon && tar -C /tmp/before -xf .device/before.tar python \
        && cp python/trainstream/_C*.so /tmp/before/python/trainstream/ && cp build/daemon/trainstreamd /tmp/before/build/daemon/
      ;;
    wheels)
      stage wheels
      install_wheels
      python3 -c "import torchao, deepspeed; print('torchao', torchao.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1
      ;;
    ds-compile)
      stage ds-compile  # DeepSpeed's cpu_adam op, compiled once (its first use would otherwise pay it)
      install_wheels
      python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" >"$OUT/ds_compile.log" 2>&1
      tail -2 "$OUT/ds_compile.log"
      ;;
    test-paging-cuda)
      stage test-paging-cuda
      timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider tests/python/test_paging_cuda.py \
        tests/python/test_cuda.py tests/python/test_cuda_auto.py ${PYTEST_ARGS:-} >"$OUT/pytest_cuda.log" 2>&1
      tail -15 "$OUT/pytest_cuda.log"
      ;;
    pytest)
      stage pytest  # only the GPU tests PYTEST_ARGS names (a change's own, when device time is short)
      timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:?} >"$OUT/pytest.log" 2>&1
      tail -5 "$OUT/pytest.log"
      ;;
    host-register)
      stage host-register  # cudaHostRegister GiB/s with 1-16 threads (fast start)
      timeout 120 python3 benchmarks/transfer/host_register.py --sizes-gib ${REGISTER_GIB:-1,8} \
        --threads ${REGISTER_THREADS:-1,4,8,16} --json "$OUT/host_register.json" 2>&1 | tail -25
      ;;
    pinned-alloc)
      stage pinned-alloc  # pinned host memory for saved activations: torch's allocator, with host registering, ours
      timeout 120 python3 benchmarks/transfer/pinned_alloc.py --total-gib ${PINNED_GIB:-8} --json "$OUT/pinned_alloc.json"
      ;;
    adamw-before-after)
      stage adamw-before-after  # the host kernels of the commit in .device/before.tar against this tree
      skip=""
      for run in $(seq "${RUNS:-2}"); do  # interleaved: the machine's bandwidth drifts between runs
        for tree in /tmp/before .; do
          name=$( [[ $tree == . ]] && echo after || echo before )
          python3 benchmarks/adamw/run.py --bench "$tree/build/benchmarks/adamw/ts_bench_adamw" --threads 16 \
            --params 100e6 --reps 5 $skip --tag "h200-16core-$name-run$run" --out-dir "$OUT" 2>&1 \
            | grep -E "^  (fp32|bf16|torch)" | head -7 | sed "s|^|[$name $run] |"
          skip=--skip-torch
        done
      done
      ;;
    adamw-ab)
      stage adamw-ab  # the kernels alone, before/after binaries alternated, each twice (the layout check's bf16-moment rows)
      for tree in /tmp/before . /tmp/before .; do
        name=$( [[ $tree == . ]] && echo after || echo before )
        "$tree/build/benchmarks/adamw/ts_bench_adamw" --threads 16 --params 100e6 --reps 5 2>&1 \
          | grep -E "bf16 moments|triad" | head -4 | sed "s|^|[$name] |"
      done
      ;;
    gpt-before-after)
      stage gpt-before-after  # the 1.86B GPT under a 24 GiB cap through the commit in .device/before.tar and this tree
      for tree in /tmp/before .; do
        name=$( [[ $tree == . ]] && echo after || echo before )
        (cd "$tree" && TRAINSTREAMD=$PWD/build/daemon/trainstreamd PYTHONPATH=$PWD/python:/tmp/site timeout 200 \
          python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --vram-cap-gib 24 --steps ${STEPS:-5} --warmup 2 \
          --modes trainstream --json "$OUT/gpt_1.86b_cap24_$name.json" 2>&1 | tail -1 | sed "s|^|[$name] |")
      done
      ;;
    gpt-paging)
      stage gpt-paging  # a GPT bigger than the cap, paged (PAGED_CONFIG, default the 1.86B under 4 GiB; WEIGHTS=bf16
      # for bf16 weights, as DeepSpeed's bf16 runs), against the GPU-only step and DeepSpeed ZeRO-3 (GPT_MODES)
      install_wheels
      config=${PAGED_CONFIG:-1.86b} weights=${WEIGHTS:-fp32}
      flags=""; [[ $weights == bf16 ]] && flags="--bf16-weights"
      timeout "${PAGED_TIMEOUT:-480}" python3 benchmarks/train_gpt/train_gpt.py --config "$config" --vram-cap-gib "${CAP:-4}" \
        --steps ${STEPS:-4} --warmup 2 --param-offload true --checkpoint-blocks --chunked-loss --moment-dtype bfloat16 \
        --uncapped-reference --modes "${GPT_MODES:-gpu-only,trainstream}" $flags ${GPT_ARGS:-} \
        --adamw-json benchmarks/results/adamw_h200-16core.json \
        --json "$OUT/gpt_${config}_cap${CAP:-4}_${weights}_paged.json" 2>&1 | tail -6
      free -g | head -2
      ;;
    wheel-info)
      stage wheel-info  # which trainstream this run uses, and what its binaries load (into wheel_info.txt)
      { nproc; free -g; df -h /dev/shm; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
        >"$OUT/machine.txt" 2>&1
      mount -o remount,size=120G /dev/shm 2>/dev/null || true
      { echo "wheel: ${wheel:-none}"; echo "PATH=$PATH"; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        echo "PYTHONPATH=${PYTHONPATH:-} TRAINSTREAMD=${TRAINSTREAMD:-}"; command -v python3 trainstreamd trainstreamctl
        trainstream --version
        python3 -c "import torch, trainstream._C as c; print('torch', torch.__version__, 'cuda', torch.cuda.is_available()); print(c.__file__)"
        site=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib'))")
        for binary in "$site"/trainstream/_C.*.so "$site"/trainstream/_bin/*; do echo "== $binary"; ldd "$binary"; done
      } >"$OUT/wheel_info.txt" 2>&1
      head -12 "$OUT/wheel_info.txt"; grep -c "trainstream.libs" "$OUT/wheel_info.txt" | sed "s/^/libraries resolved in trainstream.libs: /"
      grep -E "not found|sysroot" "$OUT/wheel_info.txt" && echo "wheel-info: a library outside the wheel (above)"
      ;;
    build)
      use_sysroot
      stage build
      { nproc; free -g; df -h /dev/shm; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
        >"$OUT/machine.txt" 2>&1
      mount -o remount,size=120G /dev/shm 2>/dev/null || true
      cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$TS_SYSROOT" \
        -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" \
        >"$OUT/build.log" 2>&1 && cmake --build build -j16 ${BUILD_TARGETS:+--target $BUILD_TARGETS} >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      ;;
    torchao)
      stage torchao  # the reference offloader, from a wheel carried in .device (the machine has no network)
      python3 -m pip install -q --no-deps --no-index .device/torchao-*.whl 2>&1 | tail -2
      python3 -c "import torchao.optim; print('torchao', torchao.__version__)" 2>&1 | tail -1
      ;;
    test)
      stage ctest
      if [[ -n ${BUILD_TARGETS:-} ]]; then
        build/tests/cpp/optimizer/ts_optimizer_test >"$OUT/ctest.log" 2>&1; tail -3 "$OUT/ctest.log"
      else
        (cd build && ctest -j8 --output-on-failure) >"$OUT/ctest.log" 2>&1; tail -5 "$OUT/ctest.log"
      fi
      stage pytest
      python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests/python} --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1
      tail -15 "$OUT/pytest.log"
      ;;
    bench-adamw)
      stage bench-adamw
      python3 benchmarks/adamw/run.py --bench build/benchmarks/adamw/ts_bench_adamw --threads 16 --params 100e6 \
        --tag h200-16core 2>&1 | tee "$OUT/bench_adamw.log" | tail -40
      cp benchmarks/results/adamw_h200-16core.json "$OUT/" 2>/dev/null
      ;;
    gpt-small)
      stage gpt-small
      T=${TRAINSTREAM_TRANSPORT:-cuda-ipc}
      python3 benchmarks/train_gpt/train_gpt.py --config 124m --adamw-json benchmarks/results/adamw_h200-16core.json --json "$OUT/gpt_124m_$T.json" 2>&1 | tail -8
      ;;
    gpt-large)
      stage gpt-large
      T=${TRAINSTREAM_TRANSPORT:-cuda-ipc}
      python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --vram-cap-gib 24 --steps 6 \
        --modes "${GPT_MODES:-gpu-only,stock,trainstream,auto}" \
        --adamw-json benchmarks/results/adamw_h200-16core.json --json "$OUT/gpt_1.86b_cap24_$T.json" 2>&1 | tail -8
      python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --steps 6 --modes stock \
        --json "$OUT/gpt_1.86b_uncapped_stock.json" 2>&1 | tail -2
      python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --vram-cap-gib 24 --steps 6 --modes trainstream \
        --bf16-weights --moment-dtype bfloat16 --adamw-json benchmarks/results/adamw_h200-16core.json \
        --json "$OUT/gpt_1.86b_cap24_bf16_$T.json" 2>&1 | tail -2
      ;;
    gpt-large-transports)
      stage gpt-large-transports  # the 1.86B under the 24 GiB cap through each transport, and its GPU-only bound
      for transport in cuda-ipc cuda-client-copy; do
        TRAINSTREAM_TRANSPORT=$transport timeout 300 python3 benchmarks/train_gpt/train_gpt.py --config 1.86b \
          --vram-cap-gib 24 --steps 6 --modes ${GPT_MODES:-gpu-only,trainstream} \
          --adamw-json benchmarks/results/adamw_h200-16core.json --json "$OUT/gpt_1.86b_cap24_$transport.json" 2>&1 | tail -2
      done
      ;;
    gpt-memory)
      stage gpt-memory  # the 1.86B under the 24 GiB cap: GPU-only, trainstream, torchao; then trainstream with paging
      # (PAGING_GIB=N pages only the first N GiB of activations)
      timeout 400 python3 benchmarks/train_gpt/train_gpt.py --config 1.86b --vram-cap-gib 24 --steps 6 \
        --modes "${GPT_MODES:-gpu-only,trainstream,torchao}" --adamw-json benchmarks/results/adamw_h200-16core.json \
        --json "$OUT/gpt_1.86b_cap24_memory.json" 2>&1 | tail -4
      for cap in ${PAGING_CAPS:-24 16}; do
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python3 benchmarks/train_gpt/train_gpt.py \
          --config 1.86b --vram-cap-gib "$cap" --steps 6 --modes trainstream --activation-paging ${PAGING_GIB:+--paging-gib $PAGING_GIB} \
          --adamw-json benchmarks/results/adamw_h200-16core.json \
          --json "$OUT/gpt_1.86b_cap${cap}_paging${PAGING_GIB:+${PAGING_GIB}gib}.json" 2>&1 | tail -2
      done
      ;;
    gpt-largest)
      stage gpt-largest
      for config in ${LARGEST_CONFIGS:-5b 7b}; do
        python3 benchmarks/train_gpt/train_gpt.py --config "$config" --batch 4 --vram-cap-gib 24 --bf16-weights ${PAGING:+--activation-paging} \
          --moment-dtype bfloat16 --steps 3 --warmup 1 --modes trainstream --adamw-json benchmarks/results/adamw_h200-16core.json \
          --json "$OUT/gpt_${config}_bf16_cap24${PAGING:+_paging}.json" \
          2>&1 | tail -3
      done
      ;;
    drop-in)
      stage drop-in  # the nanoGPT loop: the one line against the explicit options and stock (its tests: test-cuda, -m cuda)
      # NANOGPT_MODES (nanogpt_loop.py --modes), NANOGPT_TRACE=1 (--daemon-trace: per micro-batch milestones)
      timeout ${NANOGPT_TIMEOUT:-420} python3 benchmarks/drop_in/nanogpt_loop.py --steps ${NANOGPT_STEPS:-30} \
        ${NANOGPT_MODES:+--modes $NANOGPT_MODES} ${NANOGPT_TRACE:+--daemon-trace} --json "$OUT/nanogpt_loop.json" 2>&1 | tail -40
      ;;
    test-cuda)
      stage test-cuda  # with torch's default CUDA allocator and with expandable segments
      for allocator in ${CUDA_ALLOCATORS:-default expandable}; do
        conf=""; [[ $allocator == expandable ]] && conf="expandable_segments:True"
        PYTORCH_CUDA_ALLOC_CONF=$conf timeout ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests/python/test_cuda.py} \
          >"$OUT/pytest_cuda_${conf:+expandable}.log" 2>&1
        tail -3 "$OUT/pytest_cuda_${conf:+expandable}.log" | sed "s/^/[${conf:-default}] /"
      done
      ;;
    transfer)
      stage transfer
      gpus=$(nvidia-smi -L | wc -l)
      for n in $(seq "$gpus" -1 1); do
        for transport in ${TRANSPORTS:-cuda-ipc cuda-client-copy}; do
          python3 benchmarks/transfer/transfer.py --gpus "$n" --transport $transport \
            --json "$OUT/transfer_${n}gpu_$transport.json" 2>&1 | tail -1
          python3 benchmarks/transfer/transfer.py --gpus "$n" --transport $transport --daemon-threads 1 \
            --json "$OUT/transfer_${n}gpu_${transport}_1thread.json" 2>&1 | tail -1
        done
      done
      ;;
    context-probe)
      stage context-probe  # D2H from IPC-imported memory by a second process, the owner idle and busy
      timeout 60 python3 benchmarks/transfer/context_probe.py 2>&1 | tail -2
      ;;
    transfer-slots)
      stage transfer-slots  # cuda-ipc with 4 and 8 gradient staging slots, with the update and alone
      for slots in 4 8; do
        for threads in 16 1; do
          TRAINSTREAM_STAGING_SLOTS=$slots timeout 60 python3 benchmarks/transfer/transfer.py --gpus 1 \
            --transport cuda-ipc --daemon-threads $threads 2>&1 | tail -1 | sed "s/^/[slots $slots] /"
        done
      done
      ;;
    torchrun-gpt)
      stage torchrun-gpt
      python3 benchmarks/ranks/torchrun_gpt.py --measures "${MEASURES:-check,bench}" ${RANKS:+--ranks $RANKS} \
        --json "$OUT/torchrun_gpt_${MEASURES:-all}${RANKS:+_$RANKS}.json" 2>&1 | tail -6
      ;;
    ranks)
      stage ranks
      python3 benchmarks/ranks/shared_vs_private.py --ranks 4 --config 124m --json "$OUT/ranks_4x124m.json" 2>&1 | tail -3
      ;;
    allreduce)
      stage allreduce  # the peer all-reduce against gloo on loopback, one process per node, RUNS times each
      for nodes in ${NODES:-2 3 4}; do
        for run in $(seq "${RUNS:-3}"); do
          python3 benchmarks/allreduce/run.py --bench build/benchmarks/allreduce/ts_bench_allreduce --nodes "$nodes" \
            ${SIZES:+--sizes $SIZES} ${CONNECTIONS:+--connections $CONNECTIONS} --tag "h200-16core-${nodes}nodes-run$run" 2>&1 | grep MiB | sed "s/^/[$nodes nodes, run $run] /"
          cp "benchmarks/results/allreduce_h200-16core-${nodes}nodes-run$run.json" "$OUT/"
        done
      done
      ;;
    *) echo "unknown stage $what"; exit 2 ;;
  esac
done
stage done
