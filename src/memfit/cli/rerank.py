"""``memfit rerank``: relevance scores of (query, document) pairs by a cross-encoder, streamed to Parquet."""

from __future__ import annotations

import argparse

from memfit.cli.options import (
    add_job_options,
    add_record_options,
    model_options,
    note_truncated,
    say,
    start_job,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "rerank",
        help="score documents against a query (or a file of query/document pairs) with a cross-encoder",
        description="Score every document of INPUT against --query, or every (query, document) pair of INPUT, with "
        "a cross-encoder (one relevance logit, or two classes) and write OUT/part-*.parquet (id, score) "
        "and OUT/manifest.json, in input order. Long documents are cut into windows that each repeat "
        "the query; a document's score is its best window's. See docs/rerank.md.",
    )
    parser.add_argument(
        "input",
        metavar="INPUT",
        help="documents or pairs: .txt (one document per line, with --query), .jsonl, .csv, .tsv, "
        ".parquet, .arrow, or - for stdin",
    )
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="output directory")
    parser.add_argument(
        "--query",
        default=None,
        help="the one query every document is scored against (default: each record's own query)",
    )
    parser.add_argument(
        "--query-field", default=None, help="field holding each record's query, without --query (default: query)"
    )
    parser.add_argument(
        "--document-field", dest="text_field", default="text", help="field holding the document (default: text)"
    )
    add_record_options(parser)
    parser.add_argument(
        "--raw-scores",
        action="store_true",
        help="the relevance logit (log-odds for two classes) instead of a probability",
    )
    parser.add_argument(
        "--positive-label",
        default=None,
        help="the class that means relevant, for a model where it is not class 1 of two",
    )
    add_job_options(parser, required_model="a cross-encoder")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memfit.errors import ConfigError

    if args.query is not None and args.query_field is not None:
        raise ConfigError(
            "--query and --query-field exclude each other: one query for every document, or each record's own"
        )
    query_field = None if args.query is not None else (args.query_field or "query")
    start_job(args, pair_field=query_field)
    from memfit.jobs.rerank import Reranker

    reranker = Reranker(**model_options(args, positive_label=args.positive_label))
    manifest = reranker.rerank_to(
        args.input,
        args.output,
        query=args.query,
        query_field=query_field or "query",
        document_field=args.text_field,
        id_field=args.id_field,
        input_format=args.input_format,
        long=args.long,
        stride=args.stride,
        raw=args.raw_scores,
        resume=args.resume,
        part_size=args.part_size,
    )
    counts = manifest.get("counts", {})
    say(
        f"scored {manifest['rows']} (query, document) pairs ({counts.get('pairs', 0)} windows, "
        f"{counts.get('tokens', 0)} tokens) to {args.output}"
    )
    note_truncated(counts, "documents")
    return 0
