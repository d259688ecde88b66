#!/usr/bin/env bash
# Wall time of one sweep grid split over two GPUs (`sweep --devices 0,1`: one
# worker process per GPU, one merged run) vs the same grid on one GPU of the
# same host. Grid: dsv41-flash, TP4 and TP8 ranks' shapes, rows 1-8,
# correlated routing, moebench + torch-bf16 (BACKENDS overrides; two (preset, tp) groups, so each
# GPU gets one). Expected: one GPU ~3-4 min, two GPUs ~2-2.5 min (the TP8
# group, with the longest rotation, bounds it). Run on the 2xH200 host from
# the project root:
#
#   source .bundles/unpack.sh && export PYTHONPATH=$PWD:$PYTHONPATH
#   MOEBENCH_COMMIT=$(git rev-parse HEAD) scripts/sweep_shard_walltime.sh [both|sharded|one]
#
# "sharded" / "one" run half of it (each fits a 10-minute command); "both"
# (default) runs both. Writes $OUT/walltime-<mode>.txt (seconds) and the runs
# under $OUT/runs; the two runs must hold the same cases (compare with
# `moebench report RUN --baseline OTHER`).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)' 2>/dev/null; then
  echo "sweep_shard_walltime.sh: needs two CUDA GPUs and torch with CUDA; nothing run" >&2
  exit 2
fi
mode="${1:-both}"
root="${OUT:+$OUT/runs}"
root="${root:-reports/runs}"
log_dir="${OUT:-.}"
grid=(--preset dsv41-flash --tp 4,8 --rows 1-8 --scenario correlated --backends "${BACKENDS:-moebench,torch-bf16}")
rc=0

timed() {  # timed NAME -- COMMAND...: run it through device_run.sh and record the wall time
  local name=$1; shift; [ "$1" = "--" ] && shift
  local start end
  start=$(date +%s.%N)
  scripts/device_run.sh "$name" -- "$@" || rc=1
  end=$(date +%s.%N)
  python3 -c "print(f'{$end - $start:.1f}')" | tee "$log_dir/walltime-$name.txt"
}

if [ "$mode" = both ] || [ "$mode" = sharded ]; then
  timed sharded -- python3 -m moebench sweep "${grid[@]}" --devices 0,1 --label h200x2-shard2 --out "$root"
fi
if [ "$mode" = both ] || [ "$mode" = one ]; then
  timed one -- python3 -m moebench sweep "${grid[@]}" --device cuda:0 --label h200x2-shard1 --out "$root"
fi
if [ -f "$log_dir/walltime-sharded.txt" ] && [ -f "$log_dir/walltime-one.txt" ]; then
  python3 -c "s=float(open('$log_dir/walltime-sharded.txt').read()); o=float(open('$log_dir/walltime-one.txt').read()); print(f'two GPUs {s:.1f} s, one GPU {o:.1f} s: {o / s:.2f}x')"
fi
exit $rc
