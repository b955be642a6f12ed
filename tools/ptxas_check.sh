#!/usr/bin/env bash
# Compile CUDA sources for sm_90a here (no GPU needed) and print each kernel's registers, spills
# and shared memory as ptxas reports them: a check before device time is spent on a build.
#   tools/ptxas_check.sh FILE.cu [FILE.cu...]      (PYTHON: a Python with a CUDA build of torch)
# SASS_DIR=DIR also keeps each file's object there and writes its disassembly to DIR/NAME.sass
# (cuobjdump from the toolkit, the PATH, or the one triton ships).
set -euo pipefail
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CUDA_HOME=${CUDA_HOME:-$($PY -c "from apex.core.build import find_cuda_home; print(find_cuda_home())" 2>/dev/null || echo /usr/local/cuda)}
mapfile -t INCLUDES < <($PY - <<'PYEOF'
import sysconfig
from torch.utils import cpp_extension
for p in cpp_extension.include_paths():
    print("-I" + p)
import glob, os
for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
    for inc in glob.glob(os.path.join(site, "nvidia", "*", "include")):
        print("-I" + inc)
print("-I" + sysconfig.get_paths()["include"])
PYEOF
)
for src in "$@"; do
  echo "== $src"
  obj=/dev/null
  [[ -n ${SASS_DIR:-} ]] && mkdir -p "$SASS_DIR" && obj="$SASS_DIR/$(basename "$src").o"
  "$CUDA_HOME/bin/nvcc" -c -o "$obj" "$src" -gencode arch=compute_90a,code=sm_90a -std=c++20 -O3 --use_fast_math \
    --expt-relaxed-constexpr -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ \
    -U__CUDA_NO_BFLOAT16_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__ -DTORCH_EXTENSION_NAME=_C \
    "${INCLUDES[@]}" -I"$ROOT/packages/apex-core/src/apex/core/csrc/include" -I"$(dirname "$src")" \
    -Xptxas -v 2>&1 | "$PY" -c '
import re, sys
name = None
for line in sys.stdin:
    m = re.search(r"Compiling entry function .(\w+).", line)
    if m:
        name = m.group(1)
        continue
    if "error" in line or "warning" in line and "ptxas" not in line:
        print(line.rstrip())
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        spills = m.groups()
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        try:
            import subprocess
            pretty = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
        except OSError:
            pretty = name
        pretty = re.sub(r"\(anonymous namespace\)::|apex_\w+::", "", pretty)
        print(f"{m.group(1):>4} regs  spill {spills[0]}/{spills[1]}  {pretty[:150]}")
        name = None
'
  if [[ $obj != /dev/null ]]; then
    objdump=$CUDA_HOME/bin/cuobjdump
    [[ -x $objdump ]] || objdump=$(command -v cuobjdump || "$PY" -c \
      "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))")
    "$objdump" -sass "$obj" | c++filt >"$SASS_DIR/$(basename "$src").sass"
  fi
done
