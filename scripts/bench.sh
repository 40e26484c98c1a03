#!/usr/bin/env bash
# The main job: installs what is missing, builds Release, and prints what this
# CPU reaches: every usable backend on the shapes S1-S9 against the FMA peak and
# read bandwidth measured in the same run and the textbook BLIS method.
#   scripts/bench.sh [mha_bench options, e.g. --benchmark_filter=S1]
# Writes build/release/bench.json (Google Benchmark JSON),
# build/release/bench-table.txt (the table printed at the end) and
# build/release/bench.png (the same results as a picture, bench/plot_bench.py);
# with OpenMPI installed, also the ring's figures (build/release/bench-mpi.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${MHA_JOBS:-2}

scripts/install-deps.sh native plot
# Everything but the tests: the library, its plugins, the tools and the
# benchmarks, so that `cmake --install build/release` works afterwards.
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_TESTS=OFF >/dev/null
cmake --build build/release -j"$jobs"

started=$(date +%s)
build/release/bin/mha_bench --benchmark_out=build/release/bench.json \
  --benchmark_out_format=json "$@"
echo
python3 bench/print_table.py build/release/bench.json | tee build/release/bench-table.txt
# Debian's matplotlib belongs to Debian's python3, whatever python3 comes first
# on the PATH.
plot_python=/usr/bin/python3
[ -x "$plot_python" ] || plot_python=python3
"$plot_python" bench/plot_bench.py build/release/bench.json build/release/bench.png
# Context parallelism (libmha-mpi, built when OpenMPI is installed:
# scripts/install-deps.sh mpi): S2 and S6 on 2 ranks x 1 thread against one
# process with 2 threads.
if [ -x build/release/bin/mha_bench_mpi ] && command -v mpirun >/dev/null; then
  echo
  echo "ring attention, 2 ranks x 1 thread (mha_bench_mpi):"
  OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np 2 --oversubscribe --bind-to none build/release/bin/mha_bench_mpi --repeat 11 |
    tee build/release/bench-mpi.jsonl
fi
echo
echo "benchmarks ran in $(( $(date +%s) - started )) s"
