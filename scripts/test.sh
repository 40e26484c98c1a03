#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs the test suite.
#   scripts/test.sh            everything CI runs
# Build trees go to build/<config>.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${MHA_JOBS:-2}

scripts/install-deps.sh native

section() { printf '\n=== %s ===\n' "$*"; }
started=$(date +%s)

section "native Release build"
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/release -j"$jobs"
section "native Release tests"
ctest --test-dir build/release --output-on-failure -j"$jobs"

section "done in $(( $(date +%s) - started )) s"
