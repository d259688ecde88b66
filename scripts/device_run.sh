#!/usr/bin/env bash
# Run a step on the H200 host and keep a log with the header the project
# commits under reports/device-runs/: commit, command, then the full output.
#   MOEBENCH_COMMIT=<sha> scripts/device_run.sh NAME -- COMMAND...
# Writes $OUT/NAME.log (or ./NAME.log without $OUT), never over an existing
# log (a measurement's log is kept: exit 2, nothing run). Exits with COMMAND's code.
set -uo pipefail
usage="usage: device_run.sh NAME -- COMMAND... (writes \${OUT:-.}/NAME.log)"
[ $# -ge 1 ] && [ -n "$1" ] && [ "$1" != "--" ] || { echo "device_run.sh: NAME missing; $usage" >&2; exit 2; }
name=$1; shift
[ "${1:-}" = "--" ] && shift
[ $# -ge 1 ] || { echo "device_run.sh: COMMAND missing; $usage" >&2; exit 2; }
log="${OUT:-.}/$name.log"
if [ -e "$log" ] || [ -L "$log" ]; then
  echo "device_run.sh: $log exists; give another NAME (an earlier run's log is not overwritten)" >&2
  exit 2
fi
: > "$log" || { echo "device_run.sh: cannot write $log" >&2; exit 2; }
{
  echo "# commit: ${MOEBENCH_COMMIT:-unknown}"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# command: $*"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# device: /'
} >> "$log"
PYTHONUNBUFFERED=1 "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "# exit code: $rc" >> "$log"
exit "$rc"
