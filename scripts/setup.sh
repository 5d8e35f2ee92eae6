#!/usr/bin/env bash
# Installs what building and testing trainstream needs on Debian 12 / Ubuntu 22.04+: the C++ libraries
# from the distribution, and the Python dependencies (torch pinned: a CPU build here).
#   scripts/setup.sh            # system packages + Python dependencies
set -euo pipefail
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

packages=(build-essential cmake ninja-build pkg-config
          libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
          libboost-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libcli11-dev libtomlplusplus-dev
          pybind11-dev python3-dev python3-venv clang-format clang-tidy iproute2
          prometheus-cpp-dev nlohmann-json3-dev  # trainstreamd --metrics-listen; snapshots, trainstreamctl --json
          clang libclang-rt-14-dev)  # scripts/fuzz.sh: libFuzzer, ASan and UBSan are clang's
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Headless screenshots of the documentation site (TRAINSTREAM_DOCS_SHOTS=1 scripts/docs.sh); optional,
# since Ubuntu ships chromium as a snap only.
if ! dpkg -s chromium >/dev/null 2>&1; then
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
    || echo "setup: chromium not installed (only the docs screenshots need it)" >&2
fi

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q "$TORCH_SPEC"
python_packages=("pybind11>=2.12" "scikit-build-core>=0.10" pytest ninja numpy "ruff>=0.5"
  "transformers>=5" accelerate  # tests/python/test_hf_trainer.py
  peft==0.21.2  # LoRA through the Trainer: tests/python/test_hf_lora.py
  trl==1.16.0 datasets==5.2.0 lightning==2.6.6  # the trainers users run, unmodified: tests/python/test_frameworks.py
  mkdocs==1.6.1 mkdocs-material==9.8.1 "mkdocstrings[python]==1.0.8" mkdocstrings-python==2.0.11  # scripts/docs.sh
  matplotlib==3.11.2  # benchmarks/plot.py
  tqdm==4.70.1  # the examples' progress bars
  safetensors  # tests/python/test_snapshots.py reads the daemon's snapshots with it
)
"$PYTHON" -m pip install -q "${python_packages[@]}"
echo "setup: done"
