"""``memfit classify``: zero-shot labels for every text of a corpus, streamed to Parquet."""

from __future__ import annotations

import argparse

from memfit.cli.options import (
    add_input_options,
    add_job_options,
    add_executor_options,
    model_options,
    note_truncated,
    run_on_ray,
    say,
    start_job,
    stream_options,
)


def register(subparsers) -> None:
    from memfit.defaults import CLASSIFY_MODES as MODES
    from memfit.defaults import DEFAULT_SIMILARITY_THRESHOLD, DEFAULT_TEMPERATURE, DEFAULT_TEMPLATE

    parser = subparsers.add_parser(
        "classify",
        help="classify a corpus: zero-shot into labels you name, or with a trained classifier",
        description="Score every text of INPUT against each label and write OUT/part-*.parquet (id, labels "
        "best first, scores) and OUT/manifest.json. NLI models (an entailment class in their config) "
        "score (text, template-with-label) pairs exactly as transformers' zero-shot pipeline; other "
        "models compare text and label embeddings.",
    )
    add_input_options(parser)
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="output directory")
    parser.add_argument(
        "--labels",
        default=None,
        type=_split_labels,
        help="comma-separated candidate labels, e.g. 'sports,politics,science' (required except "
        "in supervised mode, where the model's own labels are the default)",
    )
    parser.add_argument(
        "--template",
        default=DEFAULT_TEMPLATE,
        help=f"hypothesis / label text with {{}} for the label (default: {DEFAULT_TEMPLATE!r})",
    )
    parser.add_argument(
        "--multi-label",
        action="store_true",
        help="score each label on its own in [0, 1] instead of a distribution over the labels",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="nli: cross-encoder with an entailment class; embedding: cosine of embeddings; "
        "supervised: a trained classifier (e.g. from memfit train) with its own labels; "
        "auto: nli with an entailment class, supervised for other classifiers, else "
        "embedding (default: auto)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help=f"embedding mode: softmax temperature on cosines (default: {DEFAULT_TEMPERATURE})",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_SIMILARITY_THRESHOLD,
        help="embedding mode with --multi-label: the cosine at which a label scores 0.5 "
        f"(default: {DEFAULT_SIMILARITY_THRESHOLD})",
    )
    add_job_options(parser, long_default="truncate")
    add_executor_options(parser)
    parser.set_defaults(run=run)


def _split_labels(text: str) -> list[str]:
    """Comma-separated labels, blanks dropped (as the transformers pipeline parses a label string)."""
    return [label.strip() for label in text.split(",") if label.strip()]


def run(args: argparse.Namespace) -> int:
    start_job(args)
    options = model_options(args, mode=args.mode, temperature=args.temperature, threshold=args.threshold)
    job_options = dict(
        labels=args.labels,
        template=args.template,
        multi_label=args.multi_label,
        part_size=args.part_size,
        **stream_options(args),
    )
    if args.executor == "ray":
        import memfit.ray

        manifest = run_on_ray(memfit.ray.classify_to, args, **options, **job_options)
        mode = manifest["settings"]["mode"]
    else:
        from memfit.jobs.classify import Classifier

        classifier = Classifier(**options)
        manifest = classifier.classify_to(args.input, args.output, **job_options)
        mode = classifier.mode
    counts = manifest.get("counts", {})
    say(
        f"classified {manifest['rows']} texts into {len(manifest['settings']['labels'])} labels "
        f"({mode} mode, {counts.get('tokens', 0)} tokens) to {args.output}"
    )
    note_truncated(counts)
    return 0
