#!/usr/bin/env bash
# clang-format check and clang-tidy (.clang-tidy) over the project's C++ (needs
# build/compile_commands.json: scripts/test.sh makes it), and ruff (pyproject.toml) over the Python.
# Exits non-zero on any finding.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cpp' | grep -v '^tests/cpp/optimizer/torch_golden')
clang-format --dry-run --Werror "${files[@]}"
mapfile -t sources < <(printf '%s\n' "${files[@]}" | grep -E '^(shm|proto|daemon|client|python|tests|benchmarks)/.*\.cpp$' |
  grep -v '^tests/fuzz/')
# Silent when clean: clang-tidy's "N warnings generated" counts system-header noise it suppressed.
# Several files per process, one process per core; any finding fails xargs, hence the script.
printf '%s\n' "${sources[@]}" | xargs -P"$(nproc)" -n4 clang-tidy -p build --quiet 2> >(grep -v "warnings\? generated" >&2)
# The fuzz harnesses compile only in the fuzz build (scripts/fuzz.sh): tidied with its commands when it exists.
if [[ -f build-fuzz/compile_commands.json ]]; then
  git ls-files 'tests/fuzz/*.cpp' | xargs -r clang-tidy -p build-fuzz --quiet 2> >(grep -v "warnings\? generated" >&2)
fi
ruff check --quiet .
