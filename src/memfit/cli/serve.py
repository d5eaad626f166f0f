"""``memfit serve``: serve embeddings, zero-shot classification and reranking over HTTP within a memory budget."""

from __future__ import annotations

import argparse
import os

from memfit.cli.options import add_long_options, add_model_options, model_options
from memfit.defaults import (
    CLASSIFY_MODES,
    DEFAULT_LOOKAHEAD,
    DEFAULT_MAX_ITEMS,
    DEFAULT_SIMILARITY_THRESHOLD,
    DEFAULT_TEMPERATURE,
)

API_KEY_ENV = "MEMFIT_API_KEY"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve embeddings (OpenAI and TEI routes), zero-shot classification and reranking over HTTP",
        description="Serve a model over HTTP: POST /v1/embeddings, /embed, /embed_all, /tokenize, /classify, /rerank, "
        "/v1/rerank; GET /health, /ready, /info, /metrics, /v1/models, /openapi.json, /docs. Requests are "
        "batched by the memory plan's token budget; the whole process stays within --memory-budget. "
        "SIGTERM drains the requests in flight. See docs/serve.md.",
    )
    # added in this order: the order of --help's usage line and of its sections
    _add_server_options(parser)
    _add_access_options(parser)
    _add_classify_options(parser)
    limits = _add_limit_options(parser)
    _add_worker_options(parser)
    _add_shutdown_option(limits)
    add_long_options(parser)
    add_model_options(parser)
    parser.set_defaults(run=run)


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    """Where the server listens, the model id it reports, whether vectors are normalized, and the int8 / uint8
    ranges they are quantized with."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model id in /v1/models and responses (default: all-MiniLM-L6-v2 for the bundled model, else the "
        "model directory's name or hub id)",
    )
    parser.add_argument(
        "--no-normalize",
        dest="normalize",
        action="store_false",
        help="return raw pooled vectors instead of unit-length ones (TEI's normalize=false)",
    )
    parser.add_argument(
        "--quantization-ranges",
        default=None,
        metavar="PATH",
        help="the output directory (or its manifest.json) of a 'memfit embed --output-dtype int8' (or uint8) run: "
        "/v1/embeddings then answers embedding_types int8 and uint8, quantized with the ranges that run calibrated "
        "on its corpus, so queries match its stored vectors. Its model, pooling and normalization must be the "
        "server's (the run needs --normalize unless the server has --no-normalize), else the server does not "
        "start; without this option int8 and uint8 get 422",
    )


def _add_access_options(parser: argparse.ArgumentParser) -> None:
    """Who may call the server (API keys) and how it is reached (TLS)."""
    access = parser.add_argument_group("access (API keys and TLS)")
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key clients must send as 'Authorization: Bearer KEY' on every route but /health and /ready; "
        f"repeat for several; also read from ${API_KEY_ENV} (comma-separated) and --api-key-file. A key on "
        "the command line shows in the process list: prefer the file or the variable",
    )
    access.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="a file of API keys, one per line (blank lines and # comments skipped)",
    )
    access.add_argument(
        "--public-metrics-and-docs",
        action="store_true",
        help="serve /metrics, /docs and /openapi.json without a key (default: they need one when keys are set)",
    )
    access.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS with this certificate (PEM)")
    access.add_argument(
        "--ssl-keyfile", default=None, metavar="PATH", help="the certificate's key (PEM), if not in the certfile"
    )


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of --api-key, $MEMFIT_API_KEY and --api-key-file, in that order."""
    from memfit.serve.auth import read_api_key_file

    keys = list(args.api_key)
    keys += [key.strip() for key in os.environ.get(API_KEY_ENV, "").split(",") if key.strip()]
    if args.api_key_file is not None:
        keys += read_api_key_file(args.api_key_file)
    return keys


def _add_classify_options(parser: argparse.ArgumentParser) -> None:
    """How /classify scores, as ``memfit classify``."""
    parser.add_argument(
        "--mode",
        choices=CLASSIFY_MODES,
        default="auto",
        help="classification mode, as memfit classify (default: auto; embedding models serve both "
        "embeddings and embedding-mode /classify)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help=f"embedding-mode /classify softmax temperature (default: {DEFAULT_TEMPERATURE})",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_SIMILARITY_THRESHOLD,
        help=f"embedding-mode multi-label threshold (default: {DEFAULT_SIMILARITY_THRESHOLD})",
    )


def _add_limit_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The limits group: requests, bodies, the queue and batching; returned for options added to it later."""
    limits = parser.add_argument_group("limits (defaults derived from the memory budget where not given)")
    limits.add_argument(
        "--max-items",
        type=int,
        default=DEFAULT_MAX_ITEMS,
        help=f"texts (and labels) per request; more gets 413 (default: {DEFAULT_MAX_ITEMS})",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="request body size; more gets 413 (default: 2 MiB, halved until the tokenizer's "
        "working memory for one body fits the budget)",
    )
    limits.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="requests in flight; more get 429 (default: up to 256, as the budget allows)",
    )
    limits.add_argument(
        "--max-queue-tokens",
        type=int,
        default=None,
        help="tokens admitted requests may hold; more get 429 with Retry-After (default: as the budget allows)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body may take to arrive; a slower or stalled one gets 408 (default: 60)",
    )
    limits.add_argument(
        "--max-wait-ms",
        type=float,
        default=1.0,
        help="how long an idle model waits for more texts before running a partial batch (default: 1)",
    )
    limits.add_argument(
        "--age-cap-ms",
        type=float,
        default=100.0,
        help="a text waiting this long rides in the next batch (default: 100)",
    )
    limits.add_argument(
        "--lookahead",
        type=int,
        default=DEFAULT_LOOKAHEAD,
        help="queued windows, oldest first, that a batch is chosen from: more sorts lengths "
        f"better, fewer keeps the order closer to arrival (default: {DEFAULT_LOOKAHEAD})",
    )
    return limits


def _add_worker_options(parser: argparse.ArgumentParser) -> None:
    """How many batches run at once, on how many CPU threads each."""
    parser.add_argument(
        "--model-workers",
        type=int,
        default=None,
        metavar="N",
        help="batches the model runs at once, sharing the token budget (default: one per CPU "
        "core on the CPU, 1 on a GPU)",
    )
    # its name until 0.1, kept unlisted for one release (embed's --workers counts Ray workers, another thing)
    parser.add_argument("--workers", dest="model_workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per model worker (default: 1)")


def _add_shutdown_option(limits: argparse._ArgumentGroup) -> None:
    """How long SIGTERM waits (listed with the limits)."""
    limits.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for requests in flight (default: 30)",
    )
    limits.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        help="seconds SIGTERM keeps serving with /ready answering 503 before it stops accepting, so a load "
        "balancer stops sending first (default: 0)",
    )


def run(args: argparse.Namespace) -> int:
    from memfit.serve import BatchingOptions, ServeOptions, serve

    options = ServeOptions(
        **model_options(args),
        long=args.long,
        stride=args.stride,
        normalize=args.normalize,
        classify_mode=args.mode,
        temperature=args.temperature,
        threshold=args.threshold,
        served_model_name=args.served_model_name,
        max_items=args.max_items,
        max_body_bytes=args.max_body_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queue_tokens=args.max_queue_tokens,
        body_timeout=args.body_timeout,
        batching=BatchingOptions(
            max_wait=args.max_wait_ms / 1000,
            age_cap=args.age_cap_ms / 1000,
            lookahead=args.lookahead,
            workers=args.model_workers,
        ),
        threads=args.threads,
        api_keys=tuple(api_keys(args)),
        public_metrics_and_docs=args.public_metrics_and_docs,
        quantization_ranges=args.quantization_ranges,
    )
    serve(
        options,
        host=args.host,
        port=args.port,
        graceful_timeout=args.graceful_timeout,
        log_level="info" if args.verbose else "warning",
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        shutdown_delay=args.shutdown_delay,
    )
    return 0
