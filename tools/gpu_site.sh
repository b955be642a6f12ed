#!/usr/bin/env bash
# Carry an ahead-of-time build from one GPU machine to the next (each machine starts bare, and a
# build of everything costs about 150 s of device time).
#
#   tools/gpu_site.sh pack DIR     # after tools/gpu_verify.sh: every installed apex distribution's
#                                  # files (their RECORDs) into DIR/site.tgz.NN, 15 MiB pieces
#   tools/gpu_site.sh unpack DIR   # on a fresh machine of the same image: into its site-packages
#
# Pack into the run's $OUT (the device returns at most 8 files of 16 MiB: about 22 MiB in two
# pieces on 2026-12-06), copy the pieces into an ignored folder of the tree, carry it to the next
# call and unpack there. Only for the same torch, CUDA and Python: `python3 -m apex.core report`
# on the new machine says whether each library still loads ahead of time.
set -euo pipefail
PY=${PYTHON:-python3}
mode=${1:?usage: tools/gpu_site.sh pack|unpack DIR}
dir=${2:?usage: tools/gpu_site.sh pack|unpack DIR}
site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
case $mode in
  pack)
    mkdir -p "$dir"
    list=$(mktemp)
    $PY - "$site" >"$list" <<'PYEOF'
import importlib.metadata
import os
import sys

site = sys.argv[1]
for dist in importlib.metadata.distributions():
    if not (dist.metadata["Name"] or "").lower().startswith("apex"):
        continue
    for name in dist.files or []:
        path = os.path.normpath(os.path.join(str(dist.locate_file("")), str(name)))
        if path.startswith(site + os.sep) and os.path.isfile(path) and "__pycache__" not in path:
            print(os.path.relpath(path, site))
PYEOF
    tar -C "$site" -cf - -T "$list" | gzip -6 | split -b 15M -d - "$dir/site.tgz."
    echo "gpu_site: $(wc -l <"$list") files from $site into $dir: $(ls "$dir" | grep -c '^site.tgz') pieces"
    rm -f "$list"
    ;;
  unpack)
    cat "$dir"/site.tgz.* | tar -xzf - -C "$site"
    echo "gpu_site: unpacked into $site"
    ;;
  *)
    echo "usage: tools/gpu_site.sh pack|unpack DIR" >&2
    exit 2
    ;;
esac
