#!/usr/bin/env bash
# clang-format check and clang-tidy (.clang-tidy) over the project's C++ (needs
# build/compile_commands.json: scripts/test.sh makes it), and ruff (pyproject.toml) over the Python.
# Exits non-zero on any finding.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cpp' | grep -v '^tests/cpp/optimizer/torch_golden')
clang-format --dry-run --Werror "${files[@]}"
mapfile -t sources < <(printf '%s\n' "${files[@]}" | grep -E '^(shm|daemon|client|python|tests|benchmarks)/.*\.cpp$')
# Silent when clean: clang-tidy's "N warnings generated" counts system-header noise it suppressed.
# Several files per process, one process per core; any finding fails xargs, hence the script.
printf '%s\n' "${sources[@]}" | xargs -P"$(nproc)" -n4 clang-tidy -p build --quiet 2> >(grep -v "warnings\? generated" >&2)
ruff check --quiet .
