"""Option choices and defaults that the command line shows, importable without torch.

The CLI builds its parser and refuses bad options from these before any heavy module (torch,
transformers) is imported, so a mistyped option is reported at once rather than after seconds of
loading. The modules that use them (models, precision, classify) import them from here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION: str = version("memfit")
    """memfit's version (``memfit.__version__``, ``memfit --version``, ``memfit serve``'s ``/info``)."""
except PackageNotFoundError:  # running from a source tree without an install
    VERSION = "0.0.0+unknown"

DTYPE_CHOICES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
POOLING_CHOICES: tuple[str, ...] = ("mean", "cls", "max")
LONG_MODES: tuple[str, ...] = ("truncate", "chunk")
OUTPUT_DTYPE_CHOICES: tuple[str, ...] = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
"""How pooled vectors are stored: floats, or quantized as sentence-transformers' ``quantize_embeddings`` does
(memfit/io/vector_codec.py)."""
INPUT_FORMATS: tuple[str, ...] = ("txt", "jsonl", "csv", "tsv", "parquet", "arrow")
QUANTIZE_CHOICES: tuple[str, ...] = ("none", "int8")
OFFLOAD_CHOICES: tuple[str, ...] = ("auto", "never", "always")
"""Whether the model's layers are streamed from its weights file (memfit/engine/streamed.py, docs/memory.md):
``auto`` only when the whole model would not fit the memory budget, ``never``, ``always``."""
BACKEND_CHOICES: tuple[str, ...] = ("auto", "torch", "openvino", "onnxruntime")
"""What runs the model: ``auto`` (on the CPU OpenVINO when installed, or ONNX Runtime in fp32 where it measured
faster on this CPU; PyTorch on GPUs and for int8 without NNCF), PyTorch eager, the OpenVINO graph compiled for the
CPU, or ONNX Runtime's (memfit/engine/registry.py, memfit/engine/backend_choice.py, docs/precision.md)."""

DEFAULT_BLOCK_TEXTS = 2048
"""Texts per block of the stream loop, and so per output part (``--part-size``), unless set."""

EXECUTORS: tuple[str, ...] = ("local", "ray")
"""Where ``memfit embed/classify`` run: this process, or Ray Data workers (``memfit[ray]``, docs/scale-out.md)."""

CLASSIFY_MODES: tuple[str, ...] = ("auto", "nli", "embedding", "supervised")
DEFAULT_TEMPLATE = "This example is {}."

# Embedding mode: cosine similarities of MiniLM-like models live in a narrow range (about 0 to 0.6),
# so they are sharpened before the softmax. 0.05 gave the lowest log-loss of 0.01-0.2 on the two
# offline labelled sets in benchmarks/quality_classify.py (see docs/classify.md); it does not change
# which label ranks first.
DEFAULT_TEMPERATURE = 0.05
# Embedding mode, multi-label: a label's score passes 0.5 exactly when its cosine passes this threshold.
DEFAULT_SIMILARITY_THRESHOLD = 0.2

# Training (memfit train): measured on gensim's polarity and 20-newsgroups subsets, docs/train.md.
DEFAULT_EPOCHS = 4
DEFAULT_LR = 2e-5
"""Peak learning rate of the pretrained encoder (and of a head that starts as the linear probe)."""
RANDOM_HEAD_LR = 2e-3
"""Peak learning rate of a randomly initialised head (``head_init="random"``): it needs larger steps."""
HEAD_INITS = ("probe", "random")
CHECKPOINTING_CHOICES = ("auto", "on", "off")
"""Gradient checkpointing, on the CLI, in the API, in ``TrainPlan`` and metrics.json alike: ``auto`` turns it
on only when one example does not fit without it (at the start, or later in the run)."""
DEFAULT_BATCH_SIZE = 16
WARMUP_FRACTION = 0.1
"""Part of the optimizer steps over which the learning rates rise linearly from 0 (then decay linearly to 0)."""

# memfit serve: texts (and labels) one request may hold; more gets 413.
DEFAULT_MAX_ITEMS = 512

DEFAULT_LOOKAHEAD = 1024
"""memfit serve: queued windows, oldest first, that the scheduler picks the next batch from."""
