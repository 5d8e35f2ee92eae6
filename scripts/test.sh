#!/usr/bin/env bash
# Builds everything (daemon, client, Python module, C++ tests) into build/ and runs the whole test
# suite: GoogleTest through ctest, then pytest against the in-tree package and real daemons.
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${BUILD:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRAINSTREAM_WERROR=ON \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" -Dpybind11_DIR="$("$PYTHON" -m pybind11 --cmakedir)" >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
(cd "$BUILD" && ctest --output-on-failure -j"$(nproc)")
export TRAINSTREAMD="$PWD/$BUILD/daemon/trainstreamd" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -m pytest -q -p no:cacheprovider "$@"
