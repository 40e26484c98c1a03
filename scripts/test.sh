#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test
# configuration CI runs, one after another (2 cores: one build at a time).
#   scripts/test.sh                 all stages
#   scripts/test.sh native asan     only these stages
# Stages: native (Release, heavy tests included), asan (AddressSanitizer +
# UndefinedBehaviorSanitizer, functional tests).
# Build trees go to build/<stage>.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${MHA_JOBS:-2}
all_stages=(native asan)
stages=("${@:-${all_stages[@]}}")

section() { printf '\n=== %s ===\n' "$*"; }
configure() {  # configure <dir> <cmake args...>
  local dir=$1; shift
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
}

stage_native() {
  scripts/install-deps.sh native
  configure build/native
  cmake --build build/native -j"$jobs"
  ctest --test-dir build/native --output-on-failure -j"$jobs"
}

stage_asan() {
  scripts/install-deps.sh native
  configure build/asan -DMHA_SANITIZE=address,undefined -DMHA_BUILD_BENCH=OFF
  cmake --build build/asan -j"$jobs"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build/asan --output-on-failure -j"$jobs" -LE heavy
}

mkdir -p build
started=$(date +%s)
summary=()
for stage in "${stages[@]}"; do
  section "$stage"
  t0=$(date +%s)
  "stage_$stage"
  summary+=("$stage: passed in $(( $(date +%s) - t0 )) s")
done
section "summary"
printf '%s\n' "${summary[@]}"
echo "all stages passed in $(( $(date +%s) - started )) s"
