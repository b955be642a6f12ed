#!/usr/bin/env bash
# Compare the kernel variants that are still switches (one build, one GPU run):
#   APEX_NORM_PREFETCH      forward: cp.async of the next tile (0 off, 1 auto)
#   APEX_NORM_LN_STATS      forward layer norm statistics: welford or two-pass
#   APEX_NORM_BWD_PREFETCH  backward: cp.async of the next tile (0 off, 1 auto)
# Prints the bench_norms table of each combination into OUTDIR/sweep_<name>.md and a summary of
# the large shapes. Usage: sweep_norms.sh OUTDIR [bench_norms args]
set -euo pipefail
OUT=${1:?usage: sweep_norms.sh OUTDIR [bench args]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
for combo in "0 welford 0" "1 welford 0" "1 two-pass 0" "1 two-pass 1" "1 welford 1"; do
  read -r fwd stats bwd <<<"$combo"
  name="fwd${fwd}_${stats}_bwd${bwd}"
  APEX_NORM_PREFETCH=$fwd APEX_NORM_LN_STATS=$stats APEX_NORM_BWD_PREFETCH=$bwd \
    python3 "$HERE/bench_norms.py" --samples 10 --quick "$@" >"$OUT/sweep_$name.md" 2>&1
  echo "== $name"
  grep -E "^\| (layer|rms)_norm \| (16384x4096|8192x8192|4096x16384|32768x1024) " "$OUT/sweep_$name.md" | cut -d'|' -f2-5,11
done
