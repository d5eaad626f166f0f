"""``memfit plan``: show the memory plan of a model on a device before running anything.

Weights, activation bytes per token, the attention term, and the largest batch with its predicted
peak at 128 / 256 / 512 tokens, against the memory budget; ``--json`` for scripts. Exit code 4 when
not even one window fits the budget.
"""

from __future__ import annotations

import argparse
import json

from memfit.cli.options import add_model_options, configure_entry_point, model_options
from memfit.errors import DoesNotFitError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show the memory plan: weights, bytes per token, largest batches, whether the budget fits",
        description="Load the model, calibrate (or read the cached) memory model and show how batches "
        "are sized under the memory budget. Nothing is embedded.",
    )
    add_model_options(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memfit.io.preflight import check_model_path, check_options

    check_options(max_length=args.max_length, memory_budget=args.memory_budget, device=args.device)
    check_model_path(args.model)
    configure_entry_point(args)
    from memfit.jobs.plan_report import plan

    report = plan(**model_options(args))
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    if not report.fits:
        raise DoesNotFitError(f"{_why_not(report)}; {_what_would_work(report)}")
    return 0


def _why_not(report) -> str:
    """What is over the budget: the model itself, before any batch, or the first window on top of it."""
    if report.baseline_bytes >= report.budget_bytes:
        return (
            f"the process holds {_mib(report.baseline_bytes)} before the first batch (runtime and model, "
            f"weights {_mib(report.weights_bytes)}), more than the memory budget of {_mib(report.budget_bytes)}"
        )
    return f"one window of {report.max_length} tokens does not fit the memory budget"


def _what_would_work(report) -> str:
    needs = [n for n in (report.resident_needs_bytes, report.streamed_needs_bytes) if n is not None]
    if needs and min(needs) > report.budget_bytes:
        return f"a --memory-budget of about {_mib(min(needs))} works" + (
            " (streamed, --offload auto)" if min(needs) == report.streamed_needs_bytes else ""
        )
    if report.baseline_bytes >= report.budget_bytes:
        return f"give a --memory-budget well above {_mib(report.baseline_bytes)}"
    return "try a smaller --max-length, --dtype bf16/fp16 or a larger --memory-budget"


def _needs(n: int | None) -> str:
    return "(cannot stream this checkpoint)" if n is None else _mib(n)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_report(report) -> str:
    """The plan as a readable table."""
    attention = (
        f"{report.bytes_per_attention_cell:.1f} B per (sequence x length^2) cell"
        if report.bytes_per_attention_cell > 0
        else "none (attention is not materialised)"
    )
    lines = [
        f"model        {report.model}",
        f"device       {report.device}, {report.dtype}, {report.attention} attention, "
        f"window {report.max_length} tokens",
        f"backend      {report.backend}; {report.backend_choice}",
        f"budget       {_mib(report.budget_bytes)}",
        f"baseline     {_mib(report.baseline_bytes)} held before the first batch "
        f"(weights {_mib(report.weights_bytes)})",
        f"activations  {report.bytes_per_token / 1024:,.1f} KiB per padded token ({report.source})",
        f"attention    {attention}",
        f"batches      up to {report.max_batch_tokens:,} padded tokens"
        + (f" per block, in sub-batches of {report.layer_batch_tokens:,}" if report.layer_batch_tokens else ""),
        f"runs         {report.execution}: resident needs about {_needs(report.resident_needs_bytes)}, "
        f"streamed about {_needs(report.streamed_needs_bytes)} (--offload)",
        "",
        f"{'length':>8}  {'largest batch':>13}  {'predicted peak':>16}",
    ]
    for row in report.lengths:
        batch = str(row.max_batch_size) if row.max_batch_size else "does not fit"
        lines.append(f"{row.padded_length:>8}  {batch:>13}  {_mib(row.predicted_peak_bytes):>16}")
    lines += ["", "fits: yes" if report.fits else f"fits: NO: {_why_not(report)}"]
    return "\n".join(lines)
