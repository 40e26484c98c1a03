#!/usr/bin/env bash
# The main job: installs what is missing, builds Release, and prints what this
# CPU reaches.  (Until the benchmark suite lands: the backends and the tests.)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${MHA_JOBS:-2}

scripts/install-deps.sh native
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/release -j"$jobs"
build/release/bin/mha-info
ctest --test-dir build/release -j"$jobs" | tail -n 3
