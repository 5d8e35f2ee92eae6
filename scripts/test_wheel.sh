#!/usr/bin/env bash
# Checks a built wheel as a user with no compiler and none of the build's libraries would meet it: installed
# into a fresh virtual environment (torch and the test extras from PyPI), nothing of the source or build
# tree on any path, and - as root - the system's copies of the libraries the wheel bundles hidden.
#   scripts/test_wheel.sh WHEEL [pytest args]   (default: a handful of tests/python, below)
#
#  1. Every library that trainstream._C, trainstreamd and trainstreamctl need resolves (ldd) inside the wheel
#     (trainstream.libs/) or to the base system: glibc, libstdc++, libgcc_s, and libz (the manylinux policies
#     let a wheel take it from the system).
#  2. As root, all that follows runs in a mount namespace where each system library that the wheel bundles a
#     copy of (named by trainstream.libs/) is covered by /dev/null: whatever still loaded the system's copy
#     would fail to load. (Not root: only the checks of 1 and 3 stand for it.)
#  3. `trainstream --version` (package and daemon agree); a daemon started by the trainstreamd launcher, its
#     mapped libraries (/proc/PID/maps) checked as in 1; the CPU example trained through the private daemon
#     that connect() starts from the package; pytest against that install.
set -euo pipefail
if [[ ${1:-} != --inside ]]; then  # the wheel's path as given, relative to where this was called from
  wheel=$(realpath -e "${1:?usage: scripts/test_wheel.sh WHEEL [pytest args]}")
fi
cd "$(dirname "$0")/.."
# glibc's libraries (libnss_* for user names), libstdc++, libgcc_s, libz: by file name.
ALLOWED='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|lib(c|m|dl|rt|pthread|resolv|nss_[a-z]+|stdc\+\+|gcc_s|z)\.so(\.[0-9]+)+)$'
DEFAULT_TESTS=(tests/python/test_packaging.py tests/python/test_daemon_cli.py tests/python/test_trainstreamctl.py
               tests/python/test_parity.py tests/python/test_snapshots.py)

# "NAME PATH" lines (PATH empty when not found) that are neither in the wheel's libraries under $1 nor allowed.
outside() {
  local site=$1 name path
  while read -r name path; do
    [[ -n $path && $(realpath -m "$path") == "$site/trainstream.libs/"* ]] && continue
    [[ $(basename "$name") =~ $ALLOWED ]] && [[ -n $path || $name == linux-vdso* || $name == /* ]] && continue
    echo "$name => ${path:-not found}"
  done
}

# The system's files of which trainstream.libs/ under $1 holds copies: libgrpc-3a193dd3.so.29.0.0 is
# auditwheel's copy of libgrpc.so.29.0.0.
bundled_on_system() {
  local lib name dir
  for lib in "$1"/trainstream.libs/*.so*; do
    name=$(basename "$lib" | sed -E 's/-[0-9a-f]{8}(\.so)/\1/')
    for dir in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /lib/x86_64-linux-gnu; do
      if [[ -f $dir/$name ]]; then realpath "$dir/$name"; fi
    done
  done | sort -u
}

inside() {  # the checks, in the namespace: inside VENV [pytest args]
  local venv=$1 site found lib daemon hidden=0
  shift
  site=$(realpath "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('platlib'))")")
  if [[ -n ${TEST_WHEEL_HIDE:-} ]]; then
    while read -r lib; do mount --bind /dev/null "$lib" && hidden=$((hidden + 1)); done < <(bundled_on_system "$site")
    echo "test_wheel: $hidden system libraries the wheel bundles are hidden (/dev/null over each)"
  fi
  for binary in "$site"/trainstream/_C.*.so "$site/trainstream/_bin/trainstreamd" "$site/trainstream/_bin/trainstreamctl"; do
    found=$(ldd "$binary" | sed -nE 's/^\s*(\S+)( => (\S+))? \(0x.*$/\1 \3/p; s/^\s*(\S+) => not found$/\1/p' | outside "$site")
    [[ -z $found ]] || { echo "test_wheel: $binary needs libraries from outside the wheel:"$'\n'"$found" >&2; return 1; }
  done
  echo "test_wheel: ldd: _C, trainstreamd and trainstreamctl need only trainstream.libs/, glibc, libstdc++, libgcc_s, libz"

  local checkout=$PWD
  cd "$(mktemp -d)"  # not the checkout: nothing there is importable by accident
  "$venv/bin/trainstream" --version
  "$venv/bin/trainstreamd" --socket "$PWD/d.sock" --threads 1 --log-level warn &
  daemon=$!
  for _ in $(seq 200); do [[ -S $PWD/d.sock ]] && break; sleep 0.1; done
  "$venv/bin/trainstreamctl" --socket "$PWD/d.sock" status >/dev/null
  found=$(grep -oE '/\S+\.so(\.[0-9.]+)?$' "/proc/$daemon/maps" | sort -u | while read -r lib; do echo "$lib $lib"; done \
    | outside "$site")
  kill "$daemon" && wait "$daemon"
  [[ -z $found ]] || { echo "test_wheel: the running trainstreamd mapped libraries from outside the wheel:"$'\n'"$found" >&2; return 1; }
  echo "test_wheel: the running trainstreamd maps only trainstream.libs/ and the base system's libraries"

  "$venv/bin/python" - "$site" <<'PY'
import sys

import trainstream
from trainstream._connect import daemon_binary

site = sys.argv[1]
assert trainstream.__file__.startswith(site + "/"), trainstream.__file__
assert daemon_binary() == f"{site}/trainstream/_bin/trainstreamd", daemon_binary()
print(f"test_wheel: trainstream {trainstream.__version__} imported from {trainstream.__file__}")
PY
  "$venv/bin/python" "$checkout/examples/train_cpu.py" --steps 50 2>&1 | tr '\r' '\n' | tail -1
  cd "$checkout"
  "$venv/bin/pytest" -q -p no:cacheprovider "$@"
}

if [[ ${1:-} == --inside ]]; then
  shift
  inside "$@"
  exit
fi

shift
(($#)) || set -- "${DEFAULT_TESTS[@]}"
python_tag=$(basename "$wheel" | cut -d- -f3)  # cp311
python=""
if command -v pyenv >/dev/null && prefix=$(pyenv prefix "3.${python_tag#cp3}" 2>/dev/null); then
  python=$prefix/bin/python3.${python_tag#cp3}
else
  python=$(command -v "python3.${python_tag#cp3}" || true)
fi
[[ -x $python ]] || { echo "test_wheel: no python3.${python_tag#cp3} to install $wheel into" >&2; exit 1; }

venv=${WHEEL_VENV:-/tmp/trainstream-wheel-venv}
rm -rf "$venv" && "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" numpy "$wheel[test,examples]"

# Nothing of the checkout or the build on any path from here on.
unset TRAINSTREAMD TRAINSTREAMCTL PYTHONPATH LD_LIBRARY_PATH LD_PRELOAD
if [[ $(id -u) -eq 0 ]]; then
  TEST_WHEEL_HIDE=1 exec unshare --mount --propagation private "$0" --inside "$venv" "$@"
fi
echo "test_wheel: not root: the system's libraries stay visible (ldd and /proc/PID/maps still check them)" >&2
exec "$0" --inside "$venv" "$@"
