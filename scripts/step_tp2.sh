#!/usr/bin/env bash
# A real TP2 decode step (2 ranks, one H200 each, NCCL with NVLink multicast
# off) of the three presets at rows 1-8, correlated routing: whole step, gate,
# per-stage split, all-reduce and its share, each case gated on the fp64
# oracle of the full unsliced layer. BACKENDS (default moebench; the torch-bf16
# layer's BF16 weights take minutes to build at dsv4-pro) picks the backends. One `moebench step` per preset (each well
# under the 10-minute command limit: ~1-3 min for dsv41/dsv4-flash, ~3-5 min
# for dsv4-pro, most of it weight generation, bf16 dequantization and the
# first kernel compiles). Run on the 2xH200 host from the project root:
#
#   source .bundles/unpack.sh && export PYTHONPATH=$PWD:$PYTHONPATH
#   MOEBENCH_COMMIT=$(git rev-parse HEAD) scripts/step_tp2.sh [PRESET ...]
#
# Runs go to $OUT/runs/<date>-h200x2-tp2-<preset> (./reports/runs without
# $OUT), logs to $OUT/step-tp2-<preset>.log (scripts/device_run.sh). Then
#   python3 -m moebench report $OUT/runs/<date>-h200x2-tp2-<preset>
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)' 2>/dev/null; then
  echo "step_tp2.sh: needs two CUDA GPUs and torch with CUDA; nothing run" >&2
  exit 2
fi
root="${OUT:+$OUT/runs}"
root="${root:-reports/runs}"
presets=("$@")
[ ${#presets[@]} -eq 0 ] && presets=(dsv41-flash dsv4-flash dsv4-pro)
rc=0
for preset in "${presets[@]}"; do
  scripts/device_run.sh "step-tp2-$preset" -- python3 -m moebench step --preset "$preset" --tp 2 \
    --devices 0,1 --rows 1-8 --scenario correlated --backends "${BACKENDS:-moebench}" --label "h200x2-tp2-$preset" --out "$root" \
    --timeout 560 || rc=1
done
exit $rc
