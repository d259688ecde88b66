#!/usr/bin/env bash
# Bundle humming-kernels for the offline H200 host: .bundles/humming.tar.xz
# (~0.35 MB; pure Python + CUDA sources + its NVRTC driver, kernels are compiled
# on the host at first use and cached in $HUMMING_CACHE_DIR, by default
# ~/.cache/moebench/humming).
#
#   scripts/build_humming_bundle.sh            (from the project root; reaches PyPI)
#
# Only humming-kernels itself: the host image already has torch, numpy and
# packaging (a matplotlib dependency) that humming imports.
set -euo pipefail
HUMMING_VERSION=${HUMMING_VERSION:-0.1.19}
MAKE_BUNDLE=${MAKE_BUNDLE:-/work/shared/device/make-bundle.sh}
nice -n 19 "$MAKE_BUNDLE" humming "humming-kernels==$HUMMING_VERSION"
