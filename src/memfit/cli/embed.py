"""``memfit embed``: pooled (and optionally token-level) embeddings of a corpus, streamed to Parquet."""

from __future__ import annotations

import argparse

from memfit.cli.options import (
    add_input_options,
    add_prompt_options,
    add_job_options,
    add_executor_options,
    add_precision_options,
    model_options,
    run_on_ray,
    say,
    start_job,
    stream_options,
)


def register(subparsers) -> None:
    from memfit.defaults import OUTPUT_DTYPE_CHOICES, POOLING_CHOICES

    parser = subparsers.add_parser(
        "embed",
        help="embed a corpus into Parquet parts + manifest.json",
        description="Embed every text of INPUT and write OUT/part-*.parquet and OUT/manifest.json. "
        "Long texts are covered by overlapping windows; batches are sized to the memory budget.",
    )
    add_input_options(parser)
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="output directory")
    parser.add_argument(
        "--pooling",
        choices=POOLING_CHOICES,
        default=None,
        help="sentence pooling (default: the model's own sentence-transformers setting, else mean)",
    )
    parser.add_argument(
        "--tokens",
        action="store_true",
        help="also write the token table OUT/tokens-*.parquet: one row per token (row, position, "
        "token_id, start, end, special, embedding); see the README",
    )
    parser.add_argument(
        "--normalize", action="store_true", help="L2-normalize the pooled embeddings (after --dimensions)"
    )
    add_prompt_options(parser)
    parser.add_argument(
        "--dimensions",
        type=int,
        default=None,
        metavar="N",
        help="keep the first N dimensions of each pooled vector, then normalize if asked "
        "(sentence-transformers' truncate_dim; for Matryoshka models; default: all)",
    )
    parser.add_argument(
        "--output-dtype",
        choices=OUTPUT_DTYPE_CHOICES,
        default="float32",
        help="storage type of pooled vectors on disk: float16 halves the size; int8 / uint8 quantize each "
        "dimension within the ranges of the first part's vectors (recorded in the manifest), binary / ubinary keep "
        "one sign bit per dimension, as sentence-transformers' quantize_embeddings (default: float32)",
    )
    add_job_options(parser)
    add_precision_options(parser)
    add_executor_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    start_job(args)
    options = model_options(args, quantize=args.quantize, min_cosine=args.min_cosine, quality_check=args.quality_check)
    job_options = dict(
        pooling=args.pooling,
        normalize=args.normalize,
        tokens=args.tokens,
        output_dtype=args.output_dtype,
        prompt_name=args.prompt_name,
        prompt=args.prompt,
        dimensions=args.dimensions,
        **stream_options(args),
    )
    if args.executor == "ray":
        import memfit.ray

        manifest = run_on_ray(memfit.ray.embed_to, args, part_size=args.part_size, **options, **job_options)
    else:
        from memfit.jobs.encoder import Encoder

        manifest = Encoder(**options).embed_to(args.input, args.output, part_size=args.part_size, **job_options)
    counts = manifest.get("counts", {})
    prompt = manifest.get("settings", {}).get("prompt")
    if prompt:
        say(f"prompt {prompt['text']!r} put before every text" + (f" ({prompt['name']})" if prompt["name"] else ""))
    say(
        f"wrote {manifest['rows']} embeddings (dim {manifest.get('dim')}, {counts.get('windows', 0)} windows, "
        f"{counts.get('tokens', 0)} tokens) to {args.output}"
    )
    if manifest.get("quality"):
        quality = manifest["quality"]
        sample = f"the first {quality['texts']} texts"
        if quality.get("source") == "cache":
            sample = f"{quality['texts']} texts of an earlier run on this machine (its pass is reused)"
        say(
            f"{quality['precision']} vs fp32 on {sample}: min cosine "
            f"{quality['min_cosine']:.5f}, mean {quality['mean_cosine']:.5f}"
        )
    if counts.get("empty_texts"):
        say(f"note: {counts['empty_texts']} empty or whitespace-only texts were embedded as empty strings")
    return 0
