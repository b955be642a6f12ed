#!/usr/bin/env bash
# Download hatchling and what it needs, as wheels for the GPU machine's Python (3.12), into .whl/
# (ignored by git). Run on a machine with an index; then pass `carry: [".whl"]` to the device
# run and tools/gpu_verify.sh installs them with --no-index before building the pure packages.
set -euo pipefail
cd "$(dirname "$0")/.."
# Resolved with dependencies (pure-Python wheels only), so a new requirement of hatchling (as
# tomlkit became) comes along instead of failing the install there.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation py --abi none \
  --platform any -d .whl hatchling
ls .whl
