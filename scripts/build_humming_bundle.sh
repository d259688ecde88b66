#!/usr/bin/env bash
# Bundle humming-kernels for the offline H200 host: .bundles/humming.tar.xz
# (~0.35 MB; pure Python + CUDA sources + its NVRTC driver, kernels are compiled
# on the host at first use and cached in $HUMMING_CACHE_DIR, by default
# ~/.cache/moebench/humming).
#
#   scripts/build_humming_bundle.sh MAKE_BUNDLE     (from the project root; reaches PyPI)
#   MAKE_BUNDLE=<path> scripts/build_humming_bundle.sh
#
# MAKE_BUNDLE: the workplace's make-bundle.sh (it packs a pip requirement into
# .bundles/<name>.tar.xz in the layout unpack.sh expects); it lives outside
# this repository, so say where.
# Only humming-kernels itself: the host image already has torch, numpy and
# packaging (a matplotlib dependency) that humming imports.
set -euo pipefail
HUMMING_VERSION=${HUMMING_VERSION:-0.1.19}
MAKE_BUNDLE=${1:-${MAKE_BUNDLE:-}}
if [ -z "$MAKE_BUNDLE" ]; then
  echo "build_humming_bundle.sh: name the workplace's make-bundle.sh (argument or MAKE_BUNDLE=...)" >&2
  exit 2
fi
if [ ! -x "$MAKE_BUNDLE" ]; then
  echo "build_humming_bundle.sh: MAKE_BUNDLE '$MAKE_BUNDLE' is not an executable file" >&2
  exit 2
fi
nice -n 19 "$MAKE_BUNDLE" humming "humming-kernels==$HUMMING_VERSION"
