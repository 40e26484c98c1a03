#!/usr/bin/env bash
# Installs the Debian packages mha needs, if any are missing.
#   scripts/install-deps.sh [native] [sanitizers] [cross] [python] [lint] [plot] [mpi]
# native: compiler, CMake, xsimd, BLIS, GoogleTest, Google Benchmark, CLI11, JSON
# sanitizers: clang, its sanitizer runtimes and LLVM's OpenMP (TSan, fuzzer),
#             valgrind (leak check) and qemu-user (qemu-x86_64 -cpu: ISA limits)
# cross: the aarch64 cross compiler, qemu-user and arm64 libraries (adds the
#        arm64 architecture to dpkg)
# python: what `pip install ./python` builds with (the compiler, CMake, Ninja,
#         xsimd, BLIS, Python's headers; libtorch's and pybind11's headers
#         for the module that reads torch tensors in C++) and what the
#         package's tests run on:
#         Debian's python3 with venv and pip, NumPy, PyTorch (1.13) and pytest
#         (the package's build requirements, scikit-build-core and nanobind,
#         come from PyPI through pip)
# lint: clang-format and clang-tidy (scripts/test.sh lint)
# plot: matplotlib, for the picture scripts/bench.sh draws (bench/plot_bench.py)
# mpi: OpenMPI (mpirun and its headers), for libmha-mpi and its tests
set -euo pipefail

want=()
for group in "${@:-native}"; do
  case "$group" in
    native)
      want+=(g++ cmake make pkgconf python3 libxsimd-dev libblis-openmp-dev libgtest-dev googletest
             libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev) ;;
    sanitizers)
      want+=(clang libclang-rt-dev libomp-dev valgrind qemu-user) ;;
    cross)
      want+=(g++-aarch64-linux-gnu qemu-user libblis-openmp-dev:arm64 libbenchmark-dev:arm64
             libgomp1:arm64 libxsimd-dev:arm64 libgtest-dev:arm64) ;;
    python)
      want+=(g++ cmake ninja-build pkgconf libxsimd-dev libblis-openmp-dev python3 python3-dev
             python3-venv python3-pip python3-numpy python3-torch python3-pytest libtorch-dev
             pybind11-dev) ;;
    lint)
      want+=(git clang-format clang-tidy python3) ;;
    plot)
      want+=(python3 python3-matplotlib) ;;
    mpi)
      want+=(openmpi-bin libopenmpi-dev) ;;
    *) echo "install-deps: unknown group '$group'" >&2; exit 2 ;;
  esac
done

missing=()
for pkg in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root to install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
if printf '%s\n' "${missing[@]}" | grep -q ':arm64$'; then
  dpkg --print-foreign-architectures | grep -qx arm64 || $sudo dpkg --add-architecture arm64
fi
echo "install-deps: installing ${missing[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
