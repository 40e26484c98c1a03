#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test
# configuration CI runs, one after another (2 cores: one build at a time).
#   scripts/test.sh                 all stages
#   scripts/test.sh native asan     only these stages
# Stages: native (Release, heavy tests included), asan (AddressSanitizer +
# UndefinedBehaviorSanitizer, functional tests), tsan (ThreadSanitizer with
# clang and LLVM's libomp, the concurrency tests and the packed / paged
# suites), fuzz (the libFuzzer targets with clang, ASan and UBSan: the C API
# 120 s and mha-run's .npy reader 20 s, on their seed corpora), leaks (valgrind over
# build/native/bin/leak_check), isa-limits (mha-info and the backend-selection
# tests under qemu-x86_64 -cpu Haswell and -cpu Nehalem, from build/native),
# aarch64 (cross build, the functional suite under qemu-aarch64), python (the
# Python package installed with pip into a venv, and its pytest suite), mpi
# (OpenMPI installed, libmha-mpi and its tests under mpirun on 1-4 local ranks,
# on 3 ranks under ASan+UBSan, and its fuzzer on one rank).
# Not among the defaults (CI's time): lint (clang-format over every tracked C
# and C++ file, clang-tidy with .clang-tidy over every translation unit of
# build/native: the library, plugins, MPI, tools, benchmarks and tests; about
# 7 minutes on 2 cores of a Zen 5) -- run it before committing: scripts/test.sh lint.
# Build trees go to build/<stage>.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${MHA_JOBS:-2}
all_stages=(native asan tsan fuzz leaks isa-limits aarch64 python mpi)
stages=("${@:-${all_stages[@]}}")

section() { printf '\n=== %s ===\n' "$*"; }
configure() {  # configure <dir> <cmake args...>
  local dir=$1; shift
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
}

stage_native() {
  scripts/install-deps.sh native plot  # plot: the benchmark picture's test
  configure build/native
  cmake --build build/native -j"$jobs"
  # The MPI tests need mpirun and run in their own stage (label mpi).
  ctest --test-dir build/native --output-on-failure -j"$jobs" -LE mpi
}

stage_asan() {
  scripts/install-deps.sh native
  configure build/asan -DMHA_SANITIZE=address,undefined -DMHA_BUILD_BENCH=OFF -DMHA_BUILD_MPI=OFF
  cmake --build build/asan -j"$jobs"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build/asan --output-on-failure -j"$jobs" -LE heavy
}

stage_tsan() {
  scripts/install-deps.sh native sanitizers
  # GCC's libgomp is not instrumented: clang and LLVM's libomp, whose OMPT tool
  # (archer) tells TSan about OpenMP's synchronisation; accesses inside the
  # uninstrumented libomp itself are ignored.  Only what the concurrency tests
  # and the packed / paged suites need (no benchmarks, no tools); none of them
  # calls the module, the one part of libmha that uses BLIS (and with it
  # libgomp).
  configure build/tsan -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DMHA_SANITIZE=thread -DMHA_BUILD_BENCH=OFF -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_MPI=OFF
  cmake --build build/tsan -j"$jobs" --target test_concurrency test_varlen test_paged
  local archer
  archer=$(clang -print-file-name=libarcher.so)
  [ -f "$archer" ] || archer=$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | head -n1)
  [ -f "$archer" ] || { echo "tsan: libarcher.so (libomp-dev) not found" >&2; return 1; }
  OMP_TOOL_LIBRARIES=$archer \
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1" \
    ctest --test-dir build/tsan --output-on-failure -L concurrency
  # The packed and paged suites on two threads each: their work items are cut
  # per sequence, balanced by cost and split over keys, and merged (the
  # scheduler's most thread-sensitive paths).
  local suite
  for suite in test_varlen test_paged; do
    OMP_TOOL_LIBRARIES=$archer MHA_NUM_THREADS=2 \
      TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1" \
      "build/tsan/bin/$suite" --gtest_brief=1
  done
}

stage_fuzz() {
  scripts/install-deps.sh native sanitizers
  configure build/fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DMHA_BUILD_FUZZER=ON -DMHA_SANITIZE=address,undefined \
    -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_BENCH=OFF -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_MPI=OFF
  cmake --build build/fuzz -j"$jobs" --target attention_fuzzer npy_fuzzer
  # New inputs go to a scratch corpus; fuzz/corpus (the seeds, and every
  # finding so far) is only read.  A fixed seed keeps CI reproducible; fuzz
  # longer with another seed by hand (fuzz/README.md).
  rm -rf build/fuzz/corpus build/fuzz/findings build/fuzz/npy-corpus
  mkdir -p build/fuzz/corpus build/fuzz/findings build/fuzz/npy-corpus
  ASAN_OPTIONS=abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    build/fuzz/bin/attention_fuzzer -seed=1 -max_total_time=120 -timeout=30 -max_len=512 \
    -print_final_stats=1 -artifact_prefix=build/fuzz/findings/ build/fuzz/corpus fuzz/corpus
  # The .npy reader of mha-run (some 20 000 inputs a second).
  ASAN_OPTIONS=abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    build/fuzz/bin/npy_fuzzer -seed=1 -max_total_time=20 -timeout=10 -max_len=1024 \
    -print_final_stats=1 -artifact_prefix=build/fuzz/findings/ build/fuzz/npy-corpus \
    fuzz/npy_corpus
}

stage_leaks() {
  scripts/install-deps.sh native sanitizers
  configure build/native
  cmake --build build/native -j"$jobs" --target leak_check
  # The one known "possibly lost" block: the TLS vector (DTV) of an OpenMP pool
  # thread, which is still alive at exit.
  cat >build/leaks.supp <<'SUPP'
{
   openmp-pool-thread-tls
   Memcheck:Leak
   match-leak-kinds: possible
   fun:calloc
   ...
   fun:_dl_allocate_tls
   ...
   fun:pthread_create*
}
SUPP
  valgrind --leak-check=full --errors-for-leak-kinds=definite,possible --error-exitcode=1 \
    --suppressions=build/leaks.supp build/native/bin/leak_check
}

# Under qemu-x86_64 -cpu <model>: the runtime must report what the model lacks,
# pick the best remaining backend, and refuse named unusable ones -- no SIGILL.
qemu_cpu() {  # qemu_cpu <model> <program> <args...>, without TCG's warnings about the model
  local cpu=$1; shift
  qemu-x86_64 -cpu "$cpu" "$@" 2> >(grep -v "TCG doesn't support requested feature" >&2)
}

stage_isa-limits() {
  if [ "$(uname -m)" != x86_64 ]; then echo "isa-limits: x86-64 only, skipped"; return 0; fi
  scripts/install-deps.sh native sanitizers
  configure build/native
  cmake --build build/native -j"$jobs" --target mha-info test_backend_selection mha-run \
    mha_tools_case
  local module_dir=build/isa-limits.module
  build/native/bin/mha_tools_case write-module "$module_dir" >/dev/null
  local cpu expect_best unusable
  for cpu in Haswell Nehalem; do
    case $cpu in
      Haswell) expect_best=avx2; unusable="avx512 avx512bf16" ;;
      Nehalem) expect_best=scalar; unusable="avx512 avx512bf16 avx2" ;;
    esac
    echo "--- qemu-x86_64 -cpu $cpu: mha-info --json"
    (unset MHA_BACKEND MHA_PLUGIN_DIR
     qemu_cpu "$cpu" build/native/bin/mha-info --json >"build/isa-limits.$cpu.json")
    python3 - "build/isa-limits.$cpu.json" "$expect_best" $unusable <<'PY'
import json, sys
path, best, unusable = sys.argv[1], sys.argv[2], sys.argv[3:]
info = json.load(open(path))
backends = {b["name"]: b for b in info["backends"]}
errors = []
for name in unusable:
    b = backends.get(name)
    if b is None:
        errors.append(f"{name} is not listed")
    elif b["usable"]:
        errors.append(f"{name} is reported usable")
    elif "lacks" not in b["reason"]:
        errors.append(f"{name}: the reason does not say what the CPU lacks: {b['reason']!r}")
for name in ["scalar", best]:
    if not backends.get(name, {}).get("usable"):
        errors.append(f"{name} should be usable")
if info.get("selected") != best:
    errors.append(f"auto selected {info.get('selected')!r}, expected {best!r}")
for name in unusable:
    print(f"  {name}: not usable: {backends.get(name, {}).get('reason')}")
print(f"  selected: {info.get('selected')}")
if errors:
    print("isa-limits: " + "; ".join(errors), file=sys.stderr)
    sys.exit(1)
PY
    echo "--- qemu-x86_64 -cpu $cpu: backend-selection tests"
    local backend
    for backend in auto scalar avx2 avx512 avx512bf16 neon; do
      (unset OMP_NUM_THREADS MHA_NUM_THREADS MHA_PLUGIN_DIR
       export MHA_BACKEND=$backend MHA_TEST_REQUESTED_BACKEND=$backend
       qemu_cpu "$cpu" build/native/bin/test_backend_selection --gtest_filter='BackendEnv.*' \
         --gtest_brief=1)
    done
    (unset MHA_BACKEND MHA_PLUGIN_DIR
     qemu_cpu "$cpu" build/native/bin/test_backend_selection --gtest_filter='BackendSelection.*' \
       --gtest_brief=1)
    # BLIS 0.x trusts BLIS_ARCH_TYPE: its skx kernels (id 0, also what it
    # reads from a name) would stop the module with SIGILL here; mha refuses
    # the call by name instead.  Empty is no choice: BLIS detects the CPU.
    echo "--- qemu-x86_64 -cpu $cpu: the module under BLIS_ARCH_TYPE=0, haswell and empty"
    local arch status
    for arch in 0 haswell ""; do
      status=0
      (unset MHA_BACKEND MHA_PLUGIN_DIR; export BLIS_ARCH_TYPE=$arch
       qemu_cpu "$cpu" build/native/bin/mha-run module --weights "$module_dir/plain" --heads 2 \
         --query "$module_dir/query.npy" --out "$module_dir/out.npy" 2>"$module_dir/err.txt") ||
        status=$?
      if [ -n "$arch" ] && ! { [ "$status" = 1 ] &&
          grep -q "BLIS_ARCH_TYPE=\"$arch\".* asks BLIS for its skx kernels" "$module_dir/err.txt"; }; then
        echo "isa-limits: BLIS_ARCH_TYPE=$arch: status $status, not the refusal" >&2
        cat "$module_dir/err.txt" >&2
        return 1
      fi
      if [ -z "$arch" ] && [ "$status" != 0 ]; then
        echo "isa-limits: BLIS_ARCH_TYPE empty: status $status" >&2
        cat "$module_dir/err.txt" >&2
        return 1
      fi
    done
    echo "  refused by name (0, haswell); empty runs"
  done
}

# The whole functional suite for aarch64 (scalar and neon), cross-compiled and
# run under qemu-aarch64.  Adds dpkg's arm64 architecture for the arm64 BLIS,
# Google Benchmark, xsimd and GoogleTest packages.
stage_aarch64() {
  scripts/install-deps.sh native cross
  configure build/aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake -DMHA_BUILD_MPI=OFF
  cmake --build build/aarch64 -j"$jobs"
  # The x86 backends' instances of the parameterised tests are left out: they
  # are not built for aarch64 and would only skip, at a qemu start each.  So
  # are the scalar backend's thread-count tests (161 s of CPU under qemu): its
  # kernel and the runtime's partitioning are the same C++ on every
  # architecture, checked at 1, 2, 3 and 7 threads by the native and ASan
  # stages; neon's run here.
  ctest --test-dir build/aarch64 --output-on-failure -j"$jobs" -LE heavy \
    -E '/(avx2|avx512|avx512bf16)(  #|$)|ThreadCounts?/scalar(  #|$)'
}

# The Python package as a user installs it: `pip install ./python` (pip fetches
# scikit-build-core and nanobind from PyPI; they build libmha, its plugins and
# the extension with the project's CMake, -j$jobs) into a venv on Debian's
# python3 that also sees Debian's NumPy, PyTorch and pytest; then its tests.
stage_python() {
  scripts/install-deps.sh python
  local venv=build/python-venv
  [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
  # build-dir keeps CMake's tree between runs of this script (CI starts fresh).
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$venv/bin/python" -m pip install --quiet \
    --disable-pip-version-check --root-user-action=ignore \
    --config-settings=build-dir="$PWD/build/python-build" ./python
  # The settings the tests choose themselves: none from the caller's environment.
  # MHA_EXPECT_TORCH_TENSORS: libtorch-dev is installed, so the package must
  # have built mha._torch_tensors (a test checks it is there and loads).
  (unset MHA_BACKEND MHA_NUM_THREADS MHA_PLUGIN_DIR MHA_VERBOSE
   MHA_EXPECT_TORCH_TENSORS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests)
}

# libmha-mpi: OpenMPI from Debian, the native tree reconfigured to build
# the MPI library, its tests and mha-run with --mpi-ring / --mpi-decode; the
# tests run under mpirun on 1, 2, 3 and 4 local ranks (--oversubscribe: more
# ranks than cores, one thread each).
stage_mpi() {
  scripts/install-deps.sh native sanitizers mpi
  configure build/native -DMHA_BUILD_MPI=ON
  cmake --build build/native -j"$jobs" --target test_mpi mha-run mha_tools_case
  (unset MHA_BACKEND MHA_NUM_THREADS MHA_PLUGIN_DIR MHA_VERBOSE
   ctest --test-dir build/native --output-on-failure -L mpi)
  # The same tests on 3 ranks under AddressSanitizer + UBSan (the asan
  # stage's tree; OpenMPI keeps its own memory until exit: no leak check).
  configure build/asan -DMHA_SANITIZE=address,undefined -DMHA_BUILD_BENCH=OFF -DMHA_BUILD_MPI=ON
  cmake --build build/asan -j"$jobs" --target test_mpi
  (unset MHA_BACKEND MHA_NUM_THREADS MHA_PLUGIN_DIR MHA_VERBOSE
   export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
   ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     mpirun -np 3 --oversubscribe -x ASAN_OPTIONS -x UBSAN_OPTIONS build/asan/bin/test_mpi)
  # libmha-mpi's entry points under the fuzzer, one rank (the fuzz stage's tree).
  configure build/fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DMHA_BUILD_FUZZER=ON -DMHA_SANITIZE=address,undefined \
    -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_BENCH=OFF -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_MPI=ON
  cmake --build build/fuzz -j"$jobs" --target mpi_fuzzer
  rm -rf build/fuzz/mpi-corpus build/fuzz/mpi-findings
  mkdir -p build/fuzz/mpi-corpus build/fuzz/mpi-findings
  (export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
   ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     build/fuzz/bin/mpi_fuzzer -seed=1 -max_total_time=30 -timeout=30 -max_len=256 \
     -print_final_stats=1 -artifact_prefix=build/fuzz/mpi-findings/ build/fuzz/mpi-corpus \
     fuzz/mpi_corpus)
}

stage_lint() {
  scripts/install-deps.sh native lint
  git ls-files -- '*.c' '*.cpp' '*.h' '*.hpp' | xargs clang-format --dry-run -Werror
  configure build/native
  # The project's own translation units (the generated plugin instances
  # included: they carry the kernels' headers), not its dependencies'.
  python3 - build/native/compile_commands.json "$PWD" >build/lint-files.txt <<'PY'
import json, sys
root = sys.argv[2] + "/"
files = sorted({e["file"] for e in json.load(open(sys.argv[1]))
                if e["file"].startswith(root) and "/_deps/" not in e["file"]})
print("\n".join(files))
PY
  echo "clang-tidy: $(wc -l <build/lint-files.txt) files"
  # (clang-tidy counts the system headers' warnings it suppresses on stderr.)
  xargs -P "$jobs" -n 1 clang-tidy -p build/native --quiet \
    --extra-arg=-Wno-unknown-warning-option <build/lint-files.txt \
    2> >(grep -v '^[0-9]* warnings\? generated\.$' >&2)
}

mkdir -p build
started=$(date +%s)
summary=()
for stage in "${stages[@]}"; do
  section "$stage"
  t0=$(date +%s)
  "stage_$stage"
  summary+=("$stage: passed in $(( $(date +%s) - t0 )) s")
  echo "--- ${summary[-1]}"  # also here: a later stage's failure ends the script
done
section "summary"
printf '%s\n' "${summary[@]}"
echo "all stages passed in $(( $(date +%s) - started )) s"
