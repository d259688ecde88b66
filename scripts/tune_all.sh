#!/usr/bin/env bash
# Tune the shipped H200 tables in one device call: every preset x TP 1,2,4,8 x
# rows 1-8 x GEMM1/GEMM2 over the 'ship' tactic space (the built-in defaults and
# their neighbours, <= 10 per stage: moebench/tuning/space.py NeighbourSpace),
# kernels compiled by cores-1 worker processes while the GPU times, the whole
# run held to a wall-time budget. Run from the project root on the H200 host:
#
#   MOEBENCH_COMMIT=<sha> BUDGET=400 scripts/tune_all.sh
#   MOEBENCH_COMMIT=<sha> BUDGET=400 FP8=1 scripts/tune_all.sh   # the FP8 family
#
# FP8=1 tunes the FP8 (wgmma) family instead (`moebench tune --fp8`, with its
# pair-or-fused step: --stages 1,2,fused): its
# entries are merged into the same tables' "fp8" part, the BF16 entries stay
# (and a BF16 run keeps the FP8 part); the log / gains files get an -fp8 suffix.
#
# Writes the tables into moebench/kernels/tables/ (where the package ships them)
# and prints the tuned-vs-default gains at rows 1, 4, 8 (µs and %). With $OUT
# set (a device call), also leaves there: tune-all.log (the full output),
# tune-gains.md / tune-gains.json (the gains) and tuning-tables.tar.gz (the
# tables: more files than a call brings back one by one). Unpack it here with
#   tar -xzf <files_at>/tuning-tables.tar.gz -C moebench/kernels/tables
#
# Env: BUDGET (seconds for the tuning itself, default 400: with the bundles'
# unpack, the ~20-30 s preflight and the tar this stays under a 9-minute
# call), PRESETS (default all), TPS (1,2,4,8), ROWS (1-8), SPACE (ship; for
# FP8=1 on one preset, full: the fp8 ship space missed dsv41-flash TP4 rows 4's
# pair by 1.6 µs, docs/perf-notes.md session 15; full took 38 / 47 s for
# dsv41-flash TP4 rows 1-7 / TP8 rows 1-8, too long for every preset and TP
# in one BUDGET), JOBS
# (compile workers, default cores - 1; 0 compiles in-process), PREFLIGHT (1:
# first check on the GPU that a worker-compiled kernel gives the same bytes as
# an in-process one, else fall back to JOBS=0), REPLAYS (50), TABLES
# (moebench/kernels/tables), FP8 (0; 1: the FP8 family). Extra arguments go to `moebench tune`. Exits with
# moebench tune's code (1 when the budget left something out or a table could
# not be written; what was done is still written and packed).
#
# Predicted (CPU-side measurements, 2026-11-29; docs/perf-notes.md "Tuning
# the shipped tables"): 226 kernels at ~0.8 s of one core each (~15 s on 15
# workers, overlapped with the timing), ~3700 CUDA-graph timings (~80 s of
# GPU), ~40 s of weights and oracles: about 3 minutes of tuning.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-}
tables=${TABLES:-moebench/kernels/tables}
fp8=${FP8:-0}
case "$fp8" in 0|1) ;; *) echo "tune_all.sh: FP8 must be 0 or 1, got '$fp8'" >&2; exit 2;; esac
sfx=$([ "$fp8" = 1 ] && echo -fp8)
log=${out:+$out/tune-all$sfx.log}
log=${log:-tune-all$sfx.log}
summary=${out:+$out/tune-gains$sfx.md}
summary=${summary:-tune-gains$sfx.md}
# An earlier run's log is kept (it was truncated without a word): refused before anything runs. Its gains
# are `moebench tune --summary`'s, which refuses existing ones unless --force is among the extra arguments.
for f in "$log" "$log.preflight"; do
  if [ -e "$f" ] || [ -L "$f" ]; then
    echo "tune_all.sh: $f exists (an earlier run's); move it away or set OUT to another folder" >&2; exit 2
  fi
done

# The H200 host has no registry: our packages come as bundles (docs/gpu-host.md).
if ! python3 -c 'import cutlass' 2>/dev/null && [ -f .bundles/unpack.sh ]; then
  # shellcheck disable=SC1091
  source .bundles/unpack.sh
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "tune_all.sh: needs a CUDA GPU (sm_90) and torch with CUDA; nothing written" >&2
  exit 2
fi
mkdir -p "$tables" ${out:+"$out"}  # $OUT may name a folder not made yet (the log goes there first)

# Preflight (~20 s): a kernel compiled by a worker process, loaded here, must
# launch and give the same bytes as one compiled here; else compile in-process.
jobs=${JOBS:-}
if [ "${PREFLIGHT:-1}" = 1 ] && [ "$jobs" != 0 ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/tuning/test_precompile.py::test_the_workers_kernel_gives_the_same_bytes_on_the_gpu > "$log.preflight" 2>&1
  if grep -q "1 passed" "$log.preflight"; then  # passed, not skipped
    echo "preflight: worker-compiled kernels OK"
  else
    echo "preflight FAILED (see $log.preflight): compiling in-process (JOBS=0)"
    jobs=0
  fi
fi

stages=1,2
[ "$fp8" = 1 ] && stages=1,2,fused  # the FP8 family also decides pair or fused per rows against the pair it tuned
cmd=(python3 -m moebench tune --preset "${PRESETS:-all}" --tp "${TPS:-1,2,4,8}" --rows "${ROWS:-1-8}"
     --stages "$stages" --space "${SPACE:-ship}" --replays "${REPLAYS:-50}" --warmup 3 --repeats 3 --top 3
     --budget "${BUDGET:-400}" --out "$tables" --summary "$summary")
[ -n "$jobs" ] && cmd+=(--jobs "$jobs")
[ "$fp8" = 1 ] && cmd+=(--fp8)
cmd+=("$@")
{
  echo "# commit: ${MOEBENCH_COMMIT:-unknown}"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# command: ${cmd[*]}"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# device: /'
  echo "# cores: $(nproc)"
} > "$log"
start=$(date +%s)
[ -f "$log.preflight" ] && { echo "# preflight:"; sed 's/^/#   /' "$log.preflight"; } >> "$log"
"${cmd[@]}" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "# exit code: $rc, $(( $(date +%s) - start )) s" | tee -a "$log"
if [ -n "$out" ]; then
  tar -czf "$out/tuning-tables.tar.gz" -C "$tables" . && echo "tables packed: $out/tuning-tables.tar.gz"
fi
exit "$rc"
