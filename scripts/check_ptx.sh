#!/usr/bin/env bash
# Assembles the device kernels shipped as PTX text (src/cuda/kernels.ptx) with ptxas, for the
# GPUs the project runs on (sm_80, sm_90): a syntax or register error fails here rather than
# at cuModuleLoadData on a GPU machine. ptxas comes from $SO_PTXAS, the PATH, or (with
# --install) NVIDIA's pip wheel nvidia-cuda-nvcc-cu12, installed into a scratch directory;
# no GPU is needed. Exits 77 when no ptxas can be had.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ptxas="${SO_PTXAS:-$(command -v ptxas || true)}"
if [ -z "$ptxas" ] && [ "${1:-}" = "--install" ]; then
    dir="${TMPDIR:-/tmp}/so-ptxas"
    if [ ! -x "$dir/nvidia/cuda_nvcc/bin/ptxas" ]; then
        python3 -m pip install -q --disable-pip-version-check --target "$dir" nvidia-cuda-nvcc-cu12 >/dev/null 2>&1 || true
    fi
    [ -x "$dir/nvidia/cuda_nvcc/bin/ptxas" ] && ptxas="$dir/nvidia/cuda_nvcc/bin/ptxas"
fi
if [ -z "$ptxas" ]; then
    echo "check_ptx: no ptxas (set SO_PTXAS, or pass --install to fetch NVIDIA's wheel)"
    exit 77
fi
ptx=src/cuda/kernels.ptx
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for arch in sm_80 sm_90; do
    "$ptxas" -arch="$arch" -o "$work/kernels-$arch.cubin" "$ptx"
done
echo "check_ptx: $ptx assembles for sm_80 and sm_90 ($("$ptxas" --version | tail -n 1))"
