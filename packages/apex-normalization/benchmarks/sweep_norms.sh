#!/usr/bin/env bash
# Compare kernel variants that are environment switches, in one GPU run (tuning, not the bars):
# each argument after OUTDIR is one combination of VAR=value settings, run through
# `bench_norms.py --quick` (device time of ours and eager PyTorch only), its table saved to
# OUTDIR/sweep_<n>.md, and the large shapes printed. The switches that exist today:
#   APEX_NORM_PREFETCH  forward: cp.async of the next tile (0 off, 1 auto, 2 always)
#   APEX_NORM_FWD_SMALL forward: the small-row kernel for one-wave problems (1 default, 0 off)
#   APEX_NORM_FWD_HOLD  forward: weight and bias held in registers (0 never, 1 default: with a bias, 2 always)
#   APEX_NORM_BWD_PREFETCH backward: cp.async of the next tile (0 off, 1 default: on when it fits)
#   APEX_NORM_BWD_VECS     backward: vectors per thread for every row (2 or 4; default by row length)
#   APEX_NORM_BWD_FINISH   backward: weight gradients summed by the kernel itself (1 default) or by a second kernel (0)
#   APEX_NORM_BWD_WHOLE    backward: the unchecked kernels for rows that fill their threads exactly (1 default, 0 off)
#
#   sweep_norms.sh OUTDIR "APEX_NORM_PREFETCH=0" "APEX_NORM_PREFETCH=1"
set -euo pipefail
OUT=${1:?usage: sweep_norms.sh OUTDIR "VAR=value ..." ...}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
n=0
for combo in "$@"; do
  n=$((n + 1))
  # shellcheck disable=SC2086  # the combination is a list of VAR=value words
  env $combo python3 "$HERE/bench_norms.py" --samples 10 --quick >"$OUT/sweep_$n.md" 2>&1
  echo "== $n: $combo"
  grep -E "^\| (layer|rms)_norm \| (16384x4096|8192x8192|4096x16384|32768x1024|1024x1024|128x4096) " "$OUT/sweep_$n.md" | cut -d'|' -f2-5,11
done
