#!/usr/bin/env bash
# Prove the kernels on a CUDA machine: build every kernel package ahead of time for this
# machine's torch and GPUs, install everything, run the GPU tests (and two-GPU tests where
# two GPUs are present) and the benchmarks, and write logs and tables into OUTDIR.
# Needs only what a CUDA PyTorch image has: python, pip, setuptools, ninja, pytest. No network.
#
#   tools/gpu_verify.sh OUTDIR [pytest args...]
#
# APEX_DISTS="apex-normalization apex-parallel" builds, tests and benchmarks only those
# distributions (and what they need): device time is short, and a build of everything is not
# always wanted. APEX_BENCH_GLOB picks benchmarks; APEX_GPU_BENCH=0 skips them, APEX_GPU_TESTS=0
# the tests (a build for a later command's own selection of tests or runs). APEX_GPU_TEST_LIMIT=S
# interrupts pytest after S seconds as Ctrl-C would: it still prints which tests failed and the
# counts (a device call's own limit kills it before that summary). The tests are those marked gpu or
# multigpu (DESIGN.md's "GPU runs": CI runs the rest); a `-m` among the pytest args replaces that.
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: tools/gpu_verify.sh OUTDIR [pytest args]}" && cd "$1" && pwd)
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
cd "$ROOT"

export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c \
  "import torch; print(';'.join(sorted({'%d.%d' % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))")}
export APEX_CACHE_DIR=${APEX_CACHE_DIR:-/tmp/apex-cache}
export PYTHONUNBUFFERED=1
# Some CUDA images point CC/CXX at a wrapper that links libstdc++ statically into extensions;
# a C++ exception thrown from such a library (every argument error) then kills Python.
# Build with the system compiler unless told otherwise.
if [[ -z ${APEX_KEEP_CC:-} && -x /usr/bin/gcc && -x /usr/bin/g++ ]]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++
fi
failed=()

echo "== $(date -u +%FT%TZ) arch ${TORCH_CUDA_ARCH_LIST} jobs ${MAX_JOBS}" | tee "$OUT/build.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/build.log" 2>&1
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" \
  | tee -a "$OUT/build.log"

# 1. Build and install in dependency order; kernel packages compile their _C here (strict).
# Pure packages build with hatchling, which CUDA images may lack: carry its wheels in .whl/
# (see tools/fetch_build_wheels.sh) and they are installed here without any index.
if ! $PY -c "import hatchling" 2>/dev/null && compgen -G ".whl/hatchling-*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --find-links .whl hatchling >>"$OUT/build.log" 2>&1
fi
has_hatchling=$($PY -c "import hatchling" 2>/dev/null && echo yes || echo no)
LOGS=$(mktemp -d)  # per-package logs, appended to build.log at the end (the device returns few files)
install() {  # kind folder jobs: one package; its log and exit status in $LOGS/<name>.log and .rc
  local kind=$1 folder=$2 jobs=$3 name start rc
  name=$(basename "$folder")
  start=$SECONDS
  if [[ $kind == kernel ]]; then
    MAX_JOBS=$jobs APEX_BUILD_OPS=1 $PY -m pip install --no-deps --no-build-isolation --no-index -v "$folder" \
      >"$LOGS/$name.log" 2>&1
  elif [[ $kind == kernel-wheel ]]; then  # compiled into a wheel in $WHEELS, installed later
    MAX_JOBS=$jobs APEX_BUILD_OPS=1 $PY -m pip wheel --no-deps --no-build-isolation --no-index -v -w "$WHEELS" \
      "$folder" >>"$LOGS/$name.log" 2>&1
  elif [[ $has_hatchling == yes ]]; then
    $PY -m pip install --no-deps --no-build-isolation --no-index "$folder" >"$LOGS/$name.log" 2>&1
  else
    echo "hatchling missing: $folder/src goes on PYTHONPATH (no entry points; found by namespace scan)" \
      >"$LOGS/$name.log"
  fi
  rc=$?
  echo "$rc" >"$LOGS/$name.rc"
  echo "== $kind $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/build.log"
}
# The packages build at once, each with one compile job per source file (at most MAX_JOBS): the
# compile of a package is as long as its slowest file, where an even share of the cores (one job
# each for ten packages on 16 cores) left the five-file packages at over three minutes.
# The first package, apex-core, goes in before them without its kernels (seconds): the others'
# setup.py import its build helpers and compile against its headers, and none links its library.
# Its kernels compile into a wheel beside the others' builds, installed over it once they are done
# (built first with every core, it held the others back by 39 s on the H100 machine).
jobs_for() {  # folder: one compile job per source file, at least 1, at most MAX_JOBS
  local sources
  sources=$(find "$1/src" \( -name '*.cu' -o -name '*.cpp' \) -not -path '*/build/*' | wc -l)
  echo "$((sources < 1 ? 1 : sources > MAX_JOBS ? MAX_JOBS : sources))"
}
WHEELS=$(mktemp -d)
# shellcheck disable=SC2086  # a list of distribution names
mapfile -t order < <($PY tools/workspace.py order ${APEX_DISTS:-})
read -r kind folder <<<"${order[0]}"
first=$(basename "$folder")
if [[ $kind == kernel ]]; then
  start=$SECONDS
  APEX_BUILD_OPS=0 $PY -m pip install --no-deps --no-build-isolation --no-index "$folder" >"$LOGS/$first.log" 2>&1
  rc=$?
  echo "== headers and build helpers $first: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/build.log"
  if [[ $rc == 0 ]]; then
    install kernel-wheel "$folder" "$(jobs_for "$folder")" &
  else
    echo "$rc" >"$LOGS/$first.rc"
  fi
else
  install "$kind" "$folder" "$MAX_JOBS"
fi
for line in "${order[@]:1}"; do
  read -r kind folder <<<"$line"
  install "$kind" "$folder" "$(jobs_for "$folder")" &
done
wait
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  start=$SECONDS
  $PY -m pip install --no-deps --no-index --force-reinstall "$WHEELS"/*.whl >>"$LOGS/$first.log" 2>&1
  rc=$?
  [[ $rc == 0 ]] || echo "$rc" >"$LOGS/$first.rc"
  echo "== kernel $first: wheel installed, rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/build.log"
fi
for line in "${order[@]}"; do
  read -r kind folder <<<"$line"
  name=$(basename "$folder")
  { echo "---- $name"; cat "$LOGS/$name.log"; } >>"$OUT/build.log"
  [[ $(cat "$LOGS/$name.rc" 2>/dev/null) == 0 ]] || failed+=("build $name")
  # Without hatchling the pure packages are imported from their sources.
  if [[ $kind == pure && $has_hatchling == no ]]; then export PYTHONPATH="$folder/src${PYTHONPATH:+:$PYTHONPATH}"; fi
done

# 2. Every kernel library must load ahead-of-time: a fallback here is a failure, not a warning.
cd /tmp
$PY -m apex.core report | tee "$OUT/report.txt"
$PY -m apex.core report --json >"$OUT/report.json"
$PY - "$OUT/report.json" <<'PYEOF' || failed+=("aot tier")
import json, sys
data = json.load(open(sys.argv[1]))
bad = [p for p in data["plugins"] if p.get("library") and p["tier"] != "aot"]
for p in bad:
    print(f"NOT AOT: {p['name']}: {p['tier']} ({p['reason']})")
sys.exit(1 if bad or data["problems"] else 0)
PYEOF
cd "$ROOT"

# 3. Tests: the packages' suites, GPU tests included (two-GPU ones run where two GPUs are visible).
folders=()
for line in "${order[@]}"; do folders+=("${line#* }"); done
if [[ ${APEX_GPU_TESTS:-1} != 0 ]]; then
  limit=()
  [[ -n ${APEX_GPU_TEST_LIMIT:-} ]] && limit=(timeout -s INT -k 30 "$APEX_GPU_TEST_LIMIT")
  "${limit[@]}" $PY -m pytest "${folders[@]}" -p no:cacheprovider -q -rs --junitxml="$OUT/pytest.xml" \
    -m "gpu or multigpu" "$@" 2>&1 \
    | tee "$OUT/pytest.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("pytest")
fi

# 4. Benchmarks, one log (APEX_GPU_BENCH=0 skips them).
: >"$OUT/benchmarks.log"
default_benches=$(printf '%s/benchmarks/bench_*.py ' "${folders[@]}")
for bench in ${APEX_BENCH_GLOB:-$default_benches}; do
  [[ ${APEX_GPU_BENCH:-1} == 0 ]] && break
  [[ -e $bench ]] || continue
  echo "== $bench" | tee -a "$OUT/benchmarks.log"
  $PY "$bench" 2>&1 | tee -a "$OUT/benchmarks.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("$bench")
done

if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}" | tee -a "$OUT/build.log"
  exit 1
fi
echo "ALL OK" | tee -a "$OUT/build.log"
