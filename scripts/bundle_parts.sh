#!/usr/bin/env bash
# A bundle too big for one device call (64 MiB with the working tree) travels in parts.
#
#   scripts/bundle_parts.sh split .bundles/NAME.tar.xz MIB
#       here: cut it into .bundles/NAME.tar.xz.part-K-of-N of at most MIB MiB each (the whole
#       file stays; carry only the parts, one call after another while the machine is warm)
#   scripts/bundle_parts.sh join
#       on the GPU host, first thing in every call that carries parts: each part under .bundles/
#       is kept in .devcache/parts/ (which outlives the call while the machine is warm, unlike
#       the carried paths); once all N parts of a bundle are there, they become
#       .bundles/NAME.tar.xz again, which `source .bundles/unpack.sh` then unpacks once.
set -euo pipefail
case "${1:-}" in
split)
  src=${2:?split needs the bundle (.bundles/NAME.tar.xz)} mib=${3:?split needs the part size in MiB}
  [ -f "$src" ] || { echo "bundle_parts.sh: no file $src" >&2; exit 2; }
  [[ "$mib" =~ ^[1-9][0-9]*$ ]] || { echo "bundle_parts.sh: MIB must be a positive integer, got $mib" >&2; exit 2; }
  size=$(stat -c %s "$src") step=$((mib * 1024 * 1024))
  n=$(((size + step - 1) / step))
  rm -f "$src".part-*-of-*
  for k in $(seq 1 "$n"); do
    dd if="$src" of="$src.part-$k-of-$n" bs=1M skip=$(((k - 1) * mib)) count="$mib" status=none
  done
  ls -l "$src".part-*-of-*
  ;;
join)
  mkdir -p .devcache/parts
  for part in .bundles/*.part-*-of-*; do
    [ -e "$part" ] && cp "$part" .devcache/parts/
  done
  for first in .devcache/parts/*.part-1-of-*; do
    [ -e "$first" ] || continue
    base=${first%.part-1-of-*} n=${first##*-of-} name=$(basename "$base")
    parts=()
    for k in $(seq 1 "$n"); do parts+=("$base.part-$k-of-$n"); done
    if ls "${parts[@]}" > /dev/null 2>&1; then
      cat "${parts[@]}" > ".bundles/$name" && rm -f "${parts[@]}"
      echo "bundle_parts.sh: .bundles/$name joined from $n parts"
    else
      echo "bundle_parts.sh: $name waits for $(for p in "${parts[@]}"; do [ -e "$p" ] || echo -n "$(basename "$p") "; done)"
    fi
  done
  ;;
*)
  echo "usage: scripts/bundle_parts.sh split .bundles/NAME.tar.xz MIB | join" >&2
  exit 2
  ;;
esac
