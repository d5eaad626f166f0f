"""Command-line options shared by several jobs (one definition each)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_model_options(
    parser: argparse.ArgumentParser,
    default_dtype: str = "auto",
    backend: bool = True,
    required_model: str | None = None,
) -> None:
    """Options every job that loads a model shares (``backend``: inference jobs choose what runs the model;
    training runs on PyTorch; ``required_model``: the kind of model a job needs where the bundled one is not of it,
    e.g. "a cross-encoder", which makes ``--model`` required)."""
    from memfit.defaults import BACKEND_CHOICES, DTYPE_CHOICES, OFFLOAD_CHOICES

    group = parser.add_argument_group("model and memory")
    if required_model is None:
        group.add_argument(
            "--model",
            default=None,
            help="local model directory or Hugging Face hub id (default: bundled all-MiniLM-L6-v2)",
        )
    else:
        group.add_argument(
            "--model",
            required=True,
            help=f"local directory or Hugging Face hub id of {required_model} (required: the bundled all-MiniLM-L6-v2 "
            "is not one)",
        )
    group.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N (default: auto)")
    group.add_argument(
        "--dtype",
        default=default_dtype,
        choices=DTYPE_CHOICES,
        help=f"compute precision; auto = bf16 on GPUs and CPUs with fast bf16, else fp32 (default: {default_dtype})",
    )
    if backend:
        group.add_argument(
            "--backend",
            default="auto",
            choices=BACKEND_CHOICES,
            help="what runs the model: auto = OpenVINO's compiled graph on the CPU when installed, "
            "PyTorch on GPUs (and for int8 without NNCF); torch; openvino; onnxruntime = ONNX Runtime in fp32 on the "
            "CPU, with the onnx extra (default: auto)",
        )
        group.add_argument(
            "--offload",
            default="auto",
            choices=OFFLOAD_CHOICES,
            help="stream the layers from the model's safetensors file, one at a time, over blocks of texts: "
            "auto = only when an explicit --memory-budget cannot hold the whole model; never; always (default: auto)",
        )
    group.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="window size in tokens incl. special tokens (default: the model's max_seq_length for embeddings, "
        "its tokenizer's model_max_length for classifiers and cross-encoders)",
    )
    group.add_argument(
        "--memory-budget",
        default=None,
        help="peak memory of the whole process, e.g. 4GiB, 500MB or 80%% (of total memory); default: "
        "what the process holds plus 90%% of the free memory",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="explain the plan: dtype, budget, batches")


def add_precision_options(parser: argparse.ArgumentParser) -> None:
    """int8 quantization and the quality guard for reduced precision (see memfit/engine/precision.py)."""
    from memfit.defaults import QUANTIZE_CHOICES

    group = parser.add_argument_group("precision")
    group.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZE_CHOICES,
        help="int8: quantized model (CPU: an int8 OpenVINO graph with NNCF installed, the int8 extra, else "
        "PyTorch's dynamic int8; CUDA: needs bitsandbytes); checked by the quality guard (default: none)",
    )
    group.add_argument(
        "--min-cosine",
        type=float,
        default=None,
        help="quality guard: refuse reduced precision whose min cosine vs fp32 on the first 64 "
        "texts is below this (default: 0.999 for bf16/fp16, 0.99 for int8)",
    )
    group.add_argument(
        "--no-quality-check",
        dest="quality_check",
        action="store_false",
        help="skip the quality guard (no fp32 comparison before the run)",
    )


def add_input_options(parser: argparse.ArgumentParser) -> None:
    """Input options shared by the jobs that read a corpus."""
    parser.add_argument(
        "input",
        metavar="INPUT",
        help="texts: .txt (one per line), .jsonl, .csv, .tsv, .parquet, .arrow, or - for stdin",
    )
    parser.add_argument("--text-field", default="text", help="field/column holding the text (default: text)")
    add_record_options(parser)


def add_record_options(parser: argparse.ArgumentParser) -> None:
    """How records are read: the id column and the input format (for every job that reads records)."""
    from memfit.defaults import INPUT_FORMATS

    parser.add_argument(
        "--id-field",
        default=None,
        help="field/column holding an id to carry to the output (default: 0-based row number)",
    )
    parser.add_argument(
        "--input-format",
        default=None,
        choices=INPUT_FORMATS,
        help="override the format guessed from the file extension (stdin defaults to txt)",
    )


def add_job_options(
    parser: argparse.ArgumentParser, long_default: str = "chunk", required_model: str | None = None
) -> None:
    """What every streamed job (embed, classify, rerank) takes after its own options: ``--resume``, the part
    size, the long-text handling (``long_default``: its default ``--long``) and the model's options
    (``required_model``: as :func:`add_model_options`)."""
    parser.add_argument(
        "--resume", action="store_true", help="continue an interrupted run in OUT after its last complete part"
    )
    add_part_size_option(parser)
    add_long_options(parser, default=long_default)
    add_model_options(parser, required_model=required_model)


def add_prompt_options(parser: argparse.ArgumentParser) -> None:
    """The prompt put before every text (a model's ``query: ``, ``passage: ``, an instruction)."""
    parser.add_argument(
        "--prompt-name",
        default=None,
        metavar="NAME",
        help="one of the prompts of the model's config_sentence_transformers.json, put before every text "
        "(default: its default_prompt_name, if it has one, as sentence-transformers does)",
    )
    parser.add_argument(
        "--prompt",
        default=None,
        metavar="TEXT",
        help="a prompt of your own, put before every text; --prompt '' turns the model's default prompt off",
    )


def add_part_size_option(parser: argparse.ArgumentParser) -> None:
    """Texts per output part: what an interrupted run keeps, and (embed) the length-sorting window."""
    from memfit.defaults import DEFAULT_BLOCK_TEXTS

    parser.add_argument(
        "--part-size",
        type=int,
        default=None,
        metavar="N",
        help="texts per Parquet part; an interrupt keeps every finished part, and texts are "
        f"sorted by length within a part (default: {DEFAULT_BLOCK_TEXTS}, at most {4 * DEFAULT_BLOCK_TEXTS}; NLI "
        f"classification holds parts to {4 * DEFAULT_BLOCK_TEXTS} // the number of labels, so that they "
        "hold about as many model inputs)",
    )


def add_long_options(parser: argparse.ArgumentParser, default: str = "chunk") -> None:
    """How texts longer than one window are handled."""
    from memfit.defaults import LONG_MODES

    parser.add_argument(
        "--long",
        default=default,
        choices=LONG_MODES,
        help=f"chunk: overlapping windows cover every token; truncate: keep the first window (default: {default})",
    )
    parser.add_argument(
        "--stride",
        type=int,
        default=None,
        help="tokens of overlap between windows with --long chunk (default: a quarter of the "
        "window, max_length // 4; in NLI classification a quarter of what the longest "
        "hypothesis leaves for the text)",
    )


def add_executor_options(parser: argparse.ArgumentParser) -> None:
    """Where the job runs: this process, or workers of a Ray cluster (docs/scale-out.md)."""
    from memfit.defaults import EXECUTORS

    group = parser.add_argument_group("scale-out")
    group.add_argument(
        "--executor",
        default="local",
        choices=EXECUTORS,
        help="local: this process; ray: Ray Data workers, each within --memory-budget, one GPU "
        "each with --device cuda; INPUT may then be a directory of Parquet files "
        "(default: local)",
    )
    # its name until 0.1: kept, unlisted, for one release (it never meant memfit/engine/, the model's runner)
    group.add_argument("--engine", dest="executor", choices=EXECUTORS, help=argparse.SUPPRESS)
    group.add_argument(
        "--workers", type=int, default=None, metavar="N", help="--executor ray: number of workers (default: 1)"
    )
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="--executor ray: join this cluster (e.g. auto, ray://head:10001); default: start a "
        "local one for the job and stop it at the end",
    )


def check_before_loading(
    args: argparse.Namespace, label_field: str | None = None, pair_field: str | None = None
) -> None:
    """Refuse, in milliseconds, what would otherwise fail after seconds of loading torch and the model:
    bad option values, an unreadable input or one without the fields asked for, an unusable output
    directory (for train, the trainer checks its own), a model path that does not exist."""
    from memfit.io.preflight import check_executor, check_input, check_model_path, check_options, check_output_dir

    executor = getattr(args, "executor", "local")
    check_executor(executor, getattr(args, "workers", None), getattr(args, "ray_address", None))
    check_options(
        part_size=getattr(args, "part_size", None),
        max_length=args.max_length,
        stride=getattr(args, "stride", None),
        memory_budget=args.memory_budget,
        device=args.device,
        dimensions=getattr(args, "dimensions", None),
        prompt_name=getattr(args, "prompt_name", None),
        prompt=getattr(args, "prompt", None),
    )
    fields = dict(
        text_field=args.text_field,
        id_field=getattr(args, "id_field", None),
        pair_field=pair_field,
        label_field=label_field,
    )
    check_input(args.input, args.input_format, **fields)
    if getattr(args, "eval", None) is not None:
        check_input(args.eval, args.input_format, **fields)
    if args.job != "train" and not (executor == "ray" and args.resume):  # Ray's resume checks its own
        check_output_dir(args.output, args.resume)
    check_model_path(args.model)


def start_job(args: argparse.Namespace, inference: bool = True, pair_field: str | None = None) -> None:
    """What every job does before it loads a model: the fast checks (:func:`check_before_loading`; ``pair_field``:
    a second text each record must have), then the process-wide settings of an entry point
    (:func:`memfit.engine.process.configure_process`)."""
    check_before_loading(args, pair_field=pair_field)
    configure_entry_point(args, inference=inference)


def configure_entry_point(args: argparse.Namespace, inference: bool = True) -> None:
    """The command's process-wide settings (:func:`memfit.engine.process.configure_process`), before a model loads."""
    from memfit.engine.process import configure_process

    configure_process(args.device, inference=inference)


def stream_options(args: argparse.Namespace) -> dict:
    """The keyword arguments a streamed job (``embed_to``, ``classify_to``) takes from the shared options."""
    return dict(
        long=args.long,
        stride=args.stride,
        text_field=args.text_field,
        id_field=args.id_field,
        input_format=args.input_format,
        resume=args.resume,
    )


def model_options(args: argparse.Namespace, **extra: object) -> dict:
    """The keyword arguments an inference job's model (``Encoder``, ``Classifier``, ``Reranker``) takes from
    :func:`add_model_options`, with ``extra`` ones of its own."""
    return dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        backend=args.backend,
        offload=args.offload,
        max_length=args.max_length,
        memory_budget=args.memory_budget,
        **extra,
    )


def run_on_ray(job: Callable[..., dict], args: argparse.Namespace, **options: object) -> dict:
    """A streamed job (``memfit.ray.embed_to``, ``classify_to``) on Ray workers, as :func:`add_executor_options`
    asked; its manifest."""
    return job(args.input, args.output, workers=args.workers or 1, address=args.ray_address, **options)


def say(message: str) -> None:
    """One of the command's own lines on stderr, as "memfit: ..."."""
    print(f"memfit: {message}", file=sys.stderr)


def note_truncated(counts: dict, what: str = "texts") -> None:
    """The note after a run with ``--long truncate``: how many ``what`` lost their tail."""
    if counts.get("truncated_texts"):
        say(
            f"note: {counts['truncated_texts']} {what} were longer than one window and truncated "
            "(--long chunk scores every part)"
        )
