#!/usr/bin/env bash
# Build FlashInfer 0.7.2.post1's reduced SM90 fused-MoE module (MXFP4 kernels
# only) on a CPU machine and pack the bundle the offline H200 host unpacks.
#
#   scripts/build_flashinfer_bundle.sh [env|build|pack|all]     (default: all)
#
# A prebuilt bundle of this layout (HEADERS=0, both MXFP4 modes) is in the
# workplace's ../shared/flashinfer/: copy it to .bundles/flashinfer.tar.xz
# instead of building (docs/baselines.md, "FlashInfer from the shared bundle").
#
# Run from the project root. Steps:
#   env    venv (system torch) with flashinfer-python + apache-tvm-ffi, and the
#          CUDA headers a minimal nvcc install lacks (cublasLt.h, curand_kernel.h,
#          nvrtc.h from the nvidia-* wheels) plus a libcuda / libnvrtc link stub.
#   build  compile the reduced module with ninja, W4A16 objects first:
#            fused_moe_90_w4a16only.so  (38 TUs: bf16 x e2m1)
#            fused_moe_90_fp4only.so    (88 TUs: + "humming" e4m3 x e2m1)
#          both linked from one object directory (no TU is compiled twice), then
#          stripped. Resumable: ninja keeps finished objects.
#   pack   trimmed flashinfer package + apache-tvm-ffi cp312 wheel + the stripped
#          .so (fp4only if built, else w4a16only; override with SO=path) in
#          FlashInfer's AOT slot flashinfer/data/aot/fused_moe_90/fused_moe_90.so
#          -> .bundles/flashinfer.tar.xz (layout site/ + wheels/, as unpack.sh wants);
#          HEADERS=auto|1|0: the CUTLASS/CCCL header trees (only a JIT fallback needs
#          them) are dropped when the tarball would exceed LIMIT (30000000) bytes
#
# Env: BUILD (default .flashinfer-build, must be git-ignored), MAX_JOBS (2),
#      ONLY=w4a16 (build stops after the W4A16 module), NICE (19),
#      UNPACK_SH (the workplace's unpack.sh, copied to .bundles/unpack.sh by
#      pack when set; it lives outside this repository).
# Background use:  nohup nice -n 19 scripts/build_flashinfer_bundle.sh all \
#                    > .flashinfer-build/build.log 2>&1 &
# Don't set LD_BIND_NOW on the host: the reduced module leaves the dropped
# kernel launchers unresolved and relies on lazy binding (tvm-ffi uses RTLD_LAZY).
set -euo pipefail
ROOT=$(pwd)
step=${1:-all}
FI_VER=0.7.2.post1
TVM_FFI_VER=${TVM_FFI_VER:-0.1.15.post2}
EXTRA_PY=${EXTRA_PY:-nvidia-ml-py tabulate einops tqdm}
BUILD=$(mkdir -p "${BUILD:-.flashinfer-build}" && cd "${BUILD:-.flashinfer-build}" && pwd)
export MAX_JOBS=${MAX_JOBS:-2}
NICE=${NICE:-19}
VENV=$BUILD/venv
PY=$VENV/bin/python
export FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=$BUILD/ws
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
PIPDL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
stamp() { echo "[$(date -u +%FT%TZ)] $*"; }

do_env() {
  stamp "env: $BUILD"
  [ -x "$PY" ] || python3 -m venv --system-site-packages "$VENV"
  "$PY" -m pip install -q --no-deps "flashinfer-python==$FI_VER" "apache-tvm-ffi==$TVM_FFI_VER"
  # what `import flashinfer` needs beyond torch/numpy here (not the optional DSL/NCCL deps)
  "$PY" -m pip install -q nvidia-ml-py tabulate tqdm einops requests packaging
  mkdir -p "$BUILD/dl" "$BUILD/cudaextra" "$BUILD/stubs"
  # headers only (minimal nvcc installs lack them); the newest cu13 wheels are fine
  [ -n "$(ls "$BUILD"/dl/nvidia_cublas-13*.whl 2>/dev/null)" ] || "${PIPDL[@]}" -d "$BUILD/dl" "nvidia-cublas"
  [ -n "$(ls "$BUILD"/dl/nvidia_cuda_nvrtc-13*.whl 2>/dev/null)" ] || "${PIPDL[@]}" -d "$BUILD/dl" "nvidia-cuda-nvrtc"
  [ -n "$(ls "$BUILD"/dl/nvidia_curand-10*.whl 2>/dev/null)" ] || "${PIPDL[@]}" -d "$BUILD/dl" "nvidia-curand==10.4.4.72"
  [ -n "$(ls "$BUILD"/dl/apache_tvm_ffi-$TVM_FFI_VER-cp312*.whl 2>/dev/null)" ] || "${PIPDL[@]}" -d "$BUILD/dl" "apache-tvm-ffi==$TVM_FFI_VER"
  [ -n "$(ls "$BUILD"/dl/flashinfer_python-$FI_VER-*.whl 2>/dev/null)" ] || "${PIPDL[@]}" -d "$BUILD/dl" "flashinfer-python==$FI_VER"
  # small pure-Python modules `import flashinfer` needs, in case the host lacks them
  mkdir -p "$BUILD/dl/extra"
  [ -n "$(ls "$BUILD"/dl/extra/*.whl 2>/dev/null)" ] || "${PIPDL[@]}" -d "$BUILD/dl/extra" $EXTRA_PY
  ( cd "$BUILD/cudaextra" && for w in "$BUILD"/dl/nvidia_*.whl; do python3 - "$w" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for n in z.namelist():
    if "/include/" in n or "/lib/libnvrtc.so" in n:
        z.extract(n, ".")
EOF
  done )
  [ -e "$BUILD/stubs/libcuda.so" ] || { echo > "$BUILD/stubs/e.c"; gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$BUILD/stubs/libcuda.so" "$BUILD/stubs/e.c"; }
  ln -sf "$BUILD/cudaextra/nvidia/cu13/lib/libnvrtc.so.13" "$BUILD/stubs/libnvrtc.so"
  FLASHINFER_CUDA_ARCH_LIST=9.0a "$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
}

do_build() {
  stamp "build start (MAX_JOBS=$MAX_JOBS, nice $NICE, ONLY=${ONLY:-both})"
  export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $BUILD/cudaextra/nvidia/cu13/include"
  # host-compiled TUs (e.g. envUtils) include cuda_runtime_api.h: the toolkit headers too
  local cuda_inc
  for cuda_inc in "$CUDA_HOME/include" /usr/local/cuda/include /usr/local/cuda-*/include; do
    [ -f "$cuda_inc/cuda_runtime_api.h" ] && break
  done
  export FLASHINFER_EXTRA_CFLAGS="-isystem $BUILD/cudaextra/nvidia/cu13/include -isystem $cuda_inc"
  export FLASHINFER_EXTRA_LDFLAGS="-L$BUILD/stubs -L$(dirname "$cuda_inc")/lib64"  # + libcudart
  nice -n "$NICE" "$PY" - "$BUILD" "${ONLY:-both}" <<'PYEOF'
import dataclasses, os, re, shutil, subprocess, sys, time
from pathlib import Path
build, only = Path(sys.argv[1]), sys.argv[2]
from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

spec = gen_cutlass_fused_moe_sm90_module()   # (re)generates the .generated.cu files
pat = {"w4a16": r"kernelLauncher<__nv_bfloat16,\s*SafeFP4", "humming": r"kernelLauncher<__nv_fp8_e4m3,\s*SafeFP4"}
static_moe = {"w4a16": "moe_gemm_kernels_bf16_fp4.cu", "humming": "moe_gemm_kernels_fp8_fp4.cu"}

def family(src):
    """'common', 'w4a16', 'humming' or None (dropped)."""
    n = src.name
    if n.endswith(".generated.cu"):
        if "_Mixed_" not in n:
            return None
        txt = src.read_text()
        for fam in ("w4a16", "humming"):
            if re.search(pat[fam], txt):
                return fam
        return None
    if n.startswith("moe_gemm_kernels_"):
        return next((f for f, s in static_moe.items() if s == n), None)
    return "common"

fams = {s: family(s) for s in spec.sources}
w4 = [s for s in spec.sources if fams[s] in ("common", "w4a16")]
hm = [s for s in spec.sources if fams[s] == "humming"]
print(f"full module {len(spec.sources)} TUs; w4a16 set {len(w4)} TUs; humming adds {len(hm)}", flush=True)
trim = dataclasses.replace(spec, name="fused_moe_90_fp4only", sources=w4 + hm,
                           extra_ldflags=list(spec.extra_ldflags or []) + ["-Wl,-z,lazy"])
trim.write_ninja()
bdir = trim.build_dir
ninja = bdir / "build.ninja"
objs = {}   # source -> object, as the generated ninja file names them
for m in re.finditer(r"^build (\S+): (?:cuda_compile|compile) (\S+)$", ninja.read_text(), re.M):
    objs[Path(m.group(2))] = m.group(1)
assert all(s in objs for s in trim.sources), "object names not found in build.ninja"
so_w4 = bdir / "fused_moe_90_w4a16only.so"
so_all = bdir / "fused_moe_90_fp4only.so"
# one object directory, two link targets
extra = bdir / "build.fp4.ninja"
extra.write_text(ninja.read_text().replace("\ndefault ", "\n# default ")
                 + f"\nbuild {so_w4}: link " + " ".join(objs[s] for s in w4) + "\n")
jobs = os.environ.get("MAX_JOBS", "2")

def run(target):
    t = time.time()
    subprocess.run(["ninja", "-v", "-C", str(bdir), "-f", str(extra), "-j", jobs, str(target)], check=True)
    print(f"[{time.strftime('%FT%TZ', time.gmtime())}] built {target.name} in {time.time() - t:.0f}s, "
          f"{target.stat().st_size / 1e6:.1f} MB", flush=True)
    out = build / "out" / (target.stem + ".stripped.so")
    out.parent.mkdir(exist_ok=True)
    subprocess.run(["strip", "--strip-unneeded", "-o", str(out), str(target)], check=True)
    print(f"stripped -> {out} {out.stat().st_size / 1e6:.1f} MB", flush=True)

run(so_w4)
if only != "w4a16":
    run(so_all)
PYEOF
  stamp "build end"
}

do_pack() {
  # HEADERS=auto (default): with the header trees unless that makes the tarball exceed LIMIT
  local limit=${LIMIT:-30000000}
  case ${HEADERS:-auto} in
    auto) pack_once 1 "$@"
          if [ "$(stat -c %s "$ROOT/.bundles/flashinfer.tar.xz")" -gt "$limit" ]; then
            stamp "over $limit bytes with headers: packing without them"; pack_once 0 "$@"
          fi ;;
    0|1) pack_once "${HEADERS}" "$@" ;;
    *) echo "HEADERS must be auto, 0 or 1"; exit 2 ;;
  esac
}

pack_once() {
  local headers=$1
  local so=${SO:-}
  if [ -z "$so" ]; then
    for c in fused_moe_90_fp4only fused_moe_90_w4a16only; do
      [ -f "$BUILD/out/$c.stripped.so" ] && { so=$BUILD/out/$c.stripped.so; break; }
    done
  fi
  [ -n "$so" ] || { echo "no built module in $BUILD/out (run the build step)"; exit 1; }
  stamp "pack with $so (headers: $headers)"
  local whl; whl=$(ls "$BUILD"/dl/flashinfer_python-$FI_VER-*.whl | head -1)
  local tvm; tvm=$(ls "$BUILD"/dl/apache_tvm_ffi-$TVM_FFI_VER-cp312*.whl | head -1)
  local stage=$BUILD/pack; rm -rf "$stage"; mkdir -p "$stage/x"
  python3 -m zipfile -e "$whl" "$stage/x"
  local S=$stage/x/flashinfer D=$stage/x/flashinfer/data T=$stage/trimmed/site
  mkdir -p "$T/flashinfer/data" "$stage/trimmed/wheels"
  # Python package (no compiled experimental assets), dist-info, data/*.py
  ( cd "$stage/x" && find flashinfer -path flashinfer/data -prune -o -type f -print ) | while read -r f; do
    case "$f" in flashinfer/experimental/*) case "$f" in *.py|*.json) ;; *) continue ;; esac ;; esac
    mkdir -p "$T/$(dirname "$f")"; cp -p "$stage/x/$f" "$T/$f"
  done
  cp -rp "$stage"/x/flashinfer_python-*.dist-info "$T/"
  rm -f "$T"/flashinfer_python-*.dist-info/RECORD
  cp -p "$D"/*.py "$T/flashinfer/data/" 2>/dev/null || true
  # Sources + headers of fused_moe_90 (unused while the AOT module loads, but
  # module generation lists them and a JIT fallback needs them). HEADERS=0 drops them.
  if [ "$headers" = 1 ]; then
    for rel in csrc/nv_internal csrc/fused_moe/cutlass_backend include cutlass/include \
               cutlass/tools/util/include cccl/cub/cub cccl/libcudacxx/include cccl/thrust/thrust spdlog/include; do
      [ -e "$D/$rel" ] || continue
      mkdir -p "$T/flashinfer/data/$(dirname "$rel")"; cp -rp "$D/$rel" "$T/flashinfer/data/$rel"
    done
    for h in "$D"/csrc/*.h "$D"/csrc/*.cuh; do [ -e "$h" ] && { mkdir -p "$T/flashinfer/data/csrc"; cp -p "$h" "$T/flashinfer/data/csrc/"; }; done
  fi
  # the JIT include dirs must exist
  mkdir -p "$T/flashinfer/data/include" "$T/flashinfer/data/csrc" "$T/flashinfer/data/spdlog/include" \
           "$T/flashinfer/data/cutlass/include" "$T/flashinfer/data/cutlass/tools/util/include" \
           "$T/flashinfer/data/cccl/cub" "$T/flashinfer/data/cccl/libcudacxx/include" \
           "$T/flashinfer/data/cccl/thrust" "$T/flashinfer/data/aot/fused_moe_90"
  cp -p "$so" "$T/flashinfer/data/aot/fused_moe_90/fused_moe_90.so"
  printf '%s\n' "$(basename "$so")" > "$T/flashinfer/data/aot/fused_moe_90/MODULE"
  cp -p "$tvm" "$stage/trimmed/wheels/"
  cp -p "$BUILD"/dl/extra/*.whl "$stage/trimmed/wheels/" 2>/dev/null || true
  find "$T" -name __pycache__ -prune -exec rm -rf {} +
  mkdir -p "$ROOT/.bundles"
  tar -C "$stage/trimmed" -cf - site wheels | xz --x86 --lzma2=preset=9e -T1 > "$ROOT/.bundles/flashinfer.tar.xz.tmp"
  mv "$ROOT/.bundles/flashinfer.tar.xz.tmp" "$ROOT/.bundles/flashinfer.tar.xz"
  if [ -n "${UNPACK_SH:-}" ]; then
    [ -f "$UNPACK_SH" ] || { echo "UNPACK_SH '$UNPACK_SH' is not a file" >&2; exit 2; }
    cp -p "$UNPACK_SH" "$ROOT/.bundles/unpack.sh"
  elif [ ! -f "$ROOT/.bundles/unpack.sh" ]; then
    stamp "no .bundles/unpack.sh: set UNPACK_SH=<the workplace's unpack.sh> to copy it there"
  fi
  stamp "wrote .bundles/flashinfer.tar.xz $(stat -c %s "$ROOT/.bundles/flashinfer.tar.xz") bytes"
}

case $step in
  env) do_env ;;
  build) do_build ;;
  pack) do_pack ;;
  all) do_env; do_build; do_pack ;;
  *) echo "usage: $0 [env|build|pack|all]"; exit 2 ;;
esac
