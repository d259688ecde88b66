#!/usr/bin/env bash
# Bundles of vLLM's MoE ops for the offline H200 host, taken from the
# vllm==0.26.0 wheel (built for torch 2.11 and CUDA 13, the host's):
#   .bundles/vllm-moe.tar.xz  site/vllm_ops/_moe_C_stable_libtorch.abi3.so (Marlin MoE GEMM,
#                             moe_align_block_size, moe_sum) + site/triton_kernels/ (OpenAI's
#                             triton_kernels as vLLM vendors it)          ~40 MB
#   .bundles/vllm-c.tar.xz    site/vllm_ops/_C_stable_libtorch.abi3.so (gptq_marlin_repack,
#                             silu_and_mul_with_clamp)                     ~55 MB
# Each is under the 64 MiB a device call carries, not both together (nor either with the DSL
# bundle): send them in consecutive calls while the machine is warm; unpack.sh keeps what it
# unpacked in .devcache/ (docs/baselines.md).
#
#   scripts/build_vllm_bundle.sh [moe|c|all]      (from the project root; reaches PyPI)
#
# Env: VLLM_WHEEL_DIR (where the 304 MB wheel is downloaded and kept; default ~/.cache/moebench/wheels).
set -euo pipefail
VLLM_VERSION=0.26.0
which=${1:-all}
case "$which" in moe|c|all) ;; *) echo "usage: $0 [moe|c|all]" >&2; exit 2;; esac
wheels=${VLLM_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/moebench/wheels}
mkdir -p "$wheels" .bundles
wheel=$(ls "$wheels"/vllm-$VLLM_VERSION-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$wheels" "vllm==$VLLM_VERSION"
  wheel=$(ls "$wheels"/vllm-$VLLM_VERSION-*.whl | head -n 1)
fi
pack() {  # pack NAME MEMBER... : the wheel's members into site/ of .bundles/NAME.tar.xz
  local name=$1; shift
  local work; work=$(mktemp -d)
  unzip -q "$wheel" "$@" -d "$work/wheel"
  mkdir -p "$work/site/vllm_ops"
  for so in "$work"/wheel/vllm/*.so; do [ -e "$so" ] && mv "$so" "$work/site/vllm_ops/"; done
  if [ -d "$work/wheel/vllm/third_party/triton_kernels" ]; then
    mv "$work/wheel/vllm/third_party/triton_kernels" "$work/site/triton_kernels"
    find "$work/site/triton_kernels" -name '__pycache__' -prune -exec rm -rf {} +
  fi
  echo "vllm==$VLLM_VERSION $*" > "$work/site/vllm_ops/$name.from"
  tar -C "$work" -cf - site | xz --x86 --lzma2=preset=9e,dict=128MiB -T1 > ".bundles/$name.tar.xz.tmp"
  mv ".bundles/$name.tar.xz.tmp" ".bundles/$name.tar.xz"
  rm -rf "$work"
  echo "wrote .bundles/$name.tar.xz ($(du -h ".bundles/$name.tar.xz" | cut -f1))"
}
if [ "$which" != c ]; then
  pack vllm-moe 'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/third_party/triton_kernels/*'
fi
if [ "$which" != moe ]; then
  pack vllm-c 'vllm/_C_stable_libtorch.abi3.so'
fi
here=$(cd "$(dirname "$0")/.." && pwd)
[ -e .bundles/unpack.sh ] || cp "$here/../shared/device/unpack.sh" .bundles/unpack.sh 2>/dev/null || true
