#!/usr/bin/env bash
# Run a step on the H200 host and keep a log with the header the project
# commits under reports/device-runs/: commit, command, then the full output.
#   MOEBENCH_COMMIT=<sha> scripts/device_run.sh NAME -- COMMAND...
# Writes $OUT/NAME.log (or ./NAME.log without $OUT). Exits with COMMAND's code.
set -uo pipefail
name=$1; shift
[ "${1:-}" = "--" ] && shift
log="${OUT:-.}/$name.log"
{
  echo "# commit: ${MOEBENCH_COMMIT:-unknown}"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# command: $*"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# device: /'
} > "$log"
PYTHONUNBUFFERED=1 "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "# exit code: $rc" >> "$log"
exit "$rc"
