"""``memfit train``: fine-tune a sequence (or relation) classifier within a memory budget."""

from __future__ import annotations

import argparse

from memfit.cli.options import add_model_options, check_before_loading, configure_entry_point, say
from memfit.defaults import (
    CHECKPOINTING_CHOICES,
    DEFAULT_BATCH_SIZE,
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    HEAD_INITS,
    INPUT_FORMATS,
    RANDOM_HEAD_LR,
    WARMUP_FRACTION,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="fine-tune a classifier; writes a Hugging Face model directory + metrics.json",
        description="Fine-tune MODEL to predict LABEL-FIELD from the texts of DATA and save it to OUT. "
        "--batch-size is the effective batch: memfit picks micro-batches, gradient accumulation, "
        "gradient checkpointing and mixed precision so training fits --memory-budget.",
    )
    _add_data_options(parser)
    _add_schedule_options(parser)
    _add_run_options(parser)
    add_model_options(parser, backend=False)
    parser.set_defaults(run=run)


def _add_data_options(parser: argparse.ArgumentParser) -> None:
    """DATA and OUT, the fields read from the records, relation markers, and the evaluation records."""
    parser.add_argument("input", metavar="DATA", help="training records: .jsonl, .csv, .tsv, .parquet or .arrow")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="output model directory")
    parser.add_argument("--text-field", default="text", help="field/column holding the text (default: text)")
    parser.add_argument("--text-pair-field", default=None, help="field holding a second text (sentence pairs)")
    parser.add_argument("--label-field", default="label", help="field/column holding the label (default: label)")
    parser.add_argument(
        "--input-format",
        default=None,
        choices=[f for f in INPUT_FORMATS if f != "txt"],
        help="override the format guessed from the file extension",
    )
    parser.add_argument(
        "--relation",
        action="store_true",
        help="relation classification: mark the head/tail entity spans (or inline [E1]…[/E1] "
        "[E2]…[/E2] markers) with entity marker tokens; see docs/train.md",
    )
    parser.add_argument("--head-field", default="head", help="with --relation: head entity span field (default: head)")
    parser.add_argument("--tail-field", default="tail", help="with --relation: tail entity span field (default: tail)")
    parser.add_argument("--eval", default=None, metavar="DATA", help="evaluation records, same format (optional)")


def _add_schedule_options(parser: argparse.ArgumentParser) -> None:
    """Epochs, learning rates, the new head's start, warm-up and the effective batch."""
    parser.add_argument(
        "--epochs",
        type=int,
        default=DEFAULT_EPOCHS,
        help=f"passes over DATA; with --eval the best epoch's model is kept (default: {DEFAULT_EPOCHS})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=DEFAULT_LR,
        help=f"AdamW peak learning rate of the encoder (default: {DEFAULT_LR:g})",
    )
    parser.add_argument(
        "--head-init",
        choices=HEAD_INITS,
        default="probe",
        help="a new head starts as the linear probe (logistic regression on the frozen encoder's "
        "vectors of DATA) or random (default: probe)",
    )
    parser.add_argument(
        "--head-lr",
        type=float,
        default=None,
        help=f"peak learning rate of a new head (default: --lr after a probe start, "
        f"{RANDOM_HEAD_LR:g} after a random one)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=WARMUP_FRACTION,
        help="fraction of the steps over which the learning rates rise from 0; then they decay "
        f"linearly to 0 (default: {WARMUP_FRACTION:g})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"effective batch per optimizer step, kept under any budget (default: {DEFAULT_BATCH_SIZE})",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """Gradient checkpointing, the seed, and checkpoints to resume from."""
    parser.add_argument(
        "--gradient-checkpointing",
        choices=CHECKPOINTING_CHOICES,
        default="auto",
        help="auto: only when one example does not fit otherwise (default: auto)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the head's initialisation and shuffling")
    parser.add_argument(
        "--resume", action="store_true", help="continue an interrupted (even killed) run from its last checkpoint"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="write a checkpoint every STEPS optimizer steps (default: every 10 minutes) and after every epoch",
    )


def run(args: argparse.Namespace) -> int:
    from memfit.io.preflight import check_training_labels

    check_before_loading(args, label_field=args.label_field, pair_field=args.text_pair_field)
    check_training_labels(args.input, args.label_field, args.input_format)
    configure_entry_point(args, inference=False)  # training keeps oneDNN's and glibc's defaults
    from memfit.training import train

    metrics = train(
        args.input,
        args.output,
        args.model,
        text_field=args.text_field,
        text_pair_field=args.text_pair_field,
        label_field=args.label_field,
        relation=args.relation,
        head_field=args.head_field,
        tail_field=args.tail_field,
        eval_data=args.eval,
        epochs=args.epochs,
        lr=args.lr,
        head_lr=args.head_lr,
        head_init=args.head_init,
        warmup=args.warmup,
        batch_size=args.batch_size,
        max_length=args.max_length,
        memory_budget=args.memory_budget,
        device=args.device,
        dtype=args.dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        seed=args.seed,
        input_format=args.input_format,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        progress=None,
        echo=say,
    )
    peak_gib = metrics["peak_memory_bytes"] / 2**30
    say(
        f"saved the model ({len(metrics['labels'])} labels) and metrics.json to {args.output}; "
        f"peak memory {peak_gib:.2f} GiB"
    )
    return 0
