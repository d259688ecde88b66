#!/usr/bin/env bash
# Split .bundles/cutedsl.tar.xz (the workplace's make-bundle.sh, ~54 MiB) in two, so that each
# part rides a device call beside the working tree (~10 MiB) under the 64 MiB a call carries:
#   .bundles/cutedsl-a.tar.xz   site/nvidia_cutlass_dsl/dsl_packages   ~48 MiB
#   .bundles/cutedsl-b.tar.xz   the rest (cu13 libraries, nvtx, metadata)   ~15 MiB
# unpack.sh unpacks both into the same .devcache/site. Send them in consecutive calls while the
# machine is warm (docs/baselines.md). The whole bundle is moved to cutedsl.whole.tar.xz.keep.
#   scripts/split_dsl_bundle.sh            (from the project root; ~5 min of xz -9e)
set -euo pipefail
src=.bundles/cutedsl.tar.xz
[ -f "$src" ] || { echo "no $src: build it first (docs/baselines.md)" >&2; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
xz -dc "$src" | tar -x -C "$work"
xz_=(xz --x86 --lzma2=preset=9e,dict=192MiB -T1)
tar -C "$work" -cf - site/nvidia_cutlass_dsl/dsl_packages | "${xz_[@]}" > .bundles/cutedsl-a.tar.xz.tmp
tar -C "$work" --exclude=site/nvidia_cutlass_dsl/dsl_packages -cf - site | "${xz_[@]}" > .bundles/cutedsl-b.tar.xz.tmp
mv .bundles/cutedsl-a.tar.xz.tmp .bundles/cutedsl-a.tar.xz
mv .bundles/cutedsl-b.tar.xz.tmp .bundles/cutedsl-b.tar.xz
mv "$src" .bundles/cutedsl.whole.tar.xz.keep
ls -la .bundles/cutedsl-a.tar.xz .bundles/cutedsl-b.tar.xz
