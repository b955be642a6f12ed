#!/usr/bin/env bash
# A/B of two builds of apex-normalization in one GPU run (tuning, not the bars). The package of
# this tree ("new") and a second source tree of it ("old": an earlier commit's, say, exported with
#   mkdir -p scratch/old && git archive REV packages/apex-normalization | tar -x -C scratch/old
# and carried to the machine) are built ahead of time into folders of OUTDIR, at once; then
# `bench_norms.py --quick` runs for old and new in turn, REPS rounds (the machine's drift falls on
# both), and the mean device time of every norm, shape and pass is printed for both, with
# new/old. Needs apex-core installed (tools/gpu_verify.sh, or pip install packages/apex-core).
#
#   ab_norms.sh OUTDIR OLD_PACKAGE_DIR [REPS]
#
# BENCH_ARGS: more arguments for bench_norms.py, e.g. "--shapes 1024x1024,2048x512 --samples 30"
# (later arguments win over the defaults above).
set -euo pipefail
OUT=$(mkdir -p "${1:?usage: ab_norms.sh OUTDIR OLD_PACKAGE_DIR [REPS]}" && cd "$1" && pwd)
OLD=$(cd "${2:?usage: ab_norms.sh OUTDIR OLD_PACKAGE_DIR [REPS]}" && pwd)
REPS=${3:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c \
  "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
export APEX_BUILD_OPS=1 PYTHONUNBUFFERED=1
# As tools/gpu_verify.sh: the system compiler, not an image's static-libstdc++ wrapper.
if [[ -z ${APEX_KEEP_CC:-} && -x /usr/bin/gcc && -x /usr/bin/g++ ]]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
jobs=$(($(nproc) / 2 > 0 ? $(nproc) / 2 : 1))
build() {  # name source
  rm -rf "${OUT:?}/$1"
  if ! MAX_JOBS=$jobs $PY -m pip install -q --no-deps --no-build-isolation --no-index --target "$OUT/$1" "$2" \
    >"$OUT/build-$1.log" 2>&1; then
    echo "ab_norms: the $1 build failed (its log: $OUT/build-$1.log)" >&2
    tail -20 "$OUT/build-$1.log" >&2
    return 1
  fi
}
start=$SECONDS
build new "$(dirname "$HERE")" &
new_pid=$!
build old "$OLD" &
old_pid=$!
wait "$new_pid" && wait "$old_pid"
echo "ab_norms: built in $((SECONDS - start)) s"
for rep in $(seq "$REPS"); do
  for side in old new; do
    if ! PYTHONPATH="$OUT/$side${PYTHONPATH:+:$PYTHONPATH}" $PY "$HERE/bench_norms.py" --quick --samples 10 ${BENCH_ARGS:-} \
      --out "$OUT/$side-$rep" >"$OUT/$side-$rep.log" 2>&1; then
      echo "ab_norms: bench_norms.py failed for the $side build, round $rep (its log: $OUT/$side-$rep.log)" >&2
      tail -20 "$OUT/$side-$rep.log" >&2
      exit 1
    fi
  done
done
echo "ab_norms: benchmarks done in $((SECONDS - start)) s"
$PY - "$OUT" <<'PYEOF'
import pathlib
import statistics
import sys

times = {}
for table in sorted(pathlib.Path(sys.argv[1]).glob("*-*/bench_norms.md")):
    side = table.parent.name.split("-")[0]
    for line in table.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 3 and cells[0] in ("layer_norm", "rms_norm") and cells[2] in ("fwd", "fwd+bwd"):
            times.setdefault(tuple(cells[:3]), {}).setdefault(side, []).append(float(cells[3]))
print("| norm | rows x hidden | pass | old ms | new ms | new/old |")
print("|---|---|---|---|---|---|")
for key, sides in times.items():
    old, new = statistics.mean(sides["old"]), statistics.mean(sides["new"])
    print(f"| {' | '.join(key)} | {old:.4f} | {new:.4f} | {new / old:.3f} |")
PYEOF
