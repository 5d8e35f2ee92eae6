#!/usr/bin/env bash
# The GPU machine's stages, run in the order named; scripts/device_run.py defines each (what it runs, the
# variables it reads, what it writes under $OUT). The device tool calls this, carrying .device:
#   scripts/device_run.sh build test bench-adamw gpt-small gpt-large
#   scripts/device_run.sh --list      # every stage and its purpose
#   scripts/device_run.sh --dry-run wheel-info test-cuda drop-in   # the commands, not run
exec python3 "$(dirname "$0")/device_run.py" "$@"
