"""Long-text benchmark: peak RSS and tokens/s for single documents of 10k-1M characters.

    python benchmarks/bench_long.py [--sizes 10000,100000,300000] [--modes normal,pooled,tokens]
                                    [--max-length 256] [--dtype auto] [--out benchmarks/results/long.json]

Documents come from ``corpus.long_documents`` (real English news text, cut to each size). Every
(mode, size) runs in its own fresh subprocess so its peak RSS is clean:

- ``pooled``: ``Encoder.embed([doc], long="chunk")`` -- one mean-pooled vector for the whole document;
- ``tokens``: ``Encoder.embed_to([doc], out, tokens=True)`` -- one vector per token, streamed to Parquet;
- ``normal``: the baseline, ``Encoder.embed`` over ordinary texts: the same document cut at spaces into
  ~600-character pieces that each fit one window (same characters, same tokens, no long text).

The claim under test: a pooled 1M-character document peaks at about the RSS of the same characters
as ordinary texts,
because its windows go through the same token-budget planner; token output grows with the text
(one float32 row per token must exist on the host before the document's Parquet row is written).
``text tok/s`` counts the tokens of the text (``len(tokenizer(doc))``); ``model tok/s`` counts the
tokens actually fed to the model (windows overlap by ``stride``, so it is higher).
Not a test: it prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

DEFAULT_SIZES = (10_000, 100_000, 300_000)  # add 1_000_000 with --sizes (~5 min more per mode on 2 cores)
MODES = ("normal", "pooled", "tokens")
NORMAL_PIECE_CHARS = 600  # ~130 MiniLM tokens: every piece fits one 256-token window


# ============================================================================ worker side


def _texts_for(mode: str, size: int, max_length: int) -> list[str]:
    import corpus

    (doc,) = corpus.long_documents((size,))
    if mode != "normal":
        return [doc]
    # the same characters as ordinary texts: cut at spaces into pieces that fit one window
    pieces, start = [], 0
    while start < len(doc):
        end = doc.find(" ", start + NORMAL_PIECE_CHARS)
        end = len(doc) if end < 0 else end
        pieces.append(doc[start:end])
        start = end
    if max(corpus.token_lengths(pieces)) > max_length:
        raise RuntimeError(f"pieces of {NORMAL_PIECE_CHARS} characters do not fit {max_length} tokens")
    return pieces


def run_worker(mode: str, size: int, max_length: int, dtype: str, report_path: str) -> None:
    import numpy as np
    import torch

    import corpus
    import memfit
    from memfit.data.chunking import window_starts

    texts = _texts_for(mode, size, max_length)
    text_tokens = sum(corpus.token_lengths(texts))
    memfit.configure_process("cpu")  # what the memfit command does before loading a model
    rss_before_load = _measure.rss_now_mib()
    with _measure.Stopwatch() as load_sw:
        encoder = memfit.Encoder(corpus.model_path(), device="cpu", dtype=dtype, max_length=max_length)
        encoder.embed(["A short warm-up sentence."])
    rss_after_load = _measure.rss_now_mib()
    stride = max_length // 4  # memfit's default, stated so the model-token count below is explicit
    content = max_length - encoder.special.single_overhead
    model_tokens = sum(
        len(window_starts(n - encoder.special.single_overhead, content, stride)) * max_length if n > max_length else n
        for n in corpus.token_lengths(texts)
    )
    extra: dict = {}
    with _measure.Stopwatch() as sw:
        if mode == "tokens":
            out_dir = tempfile.mkdtemp(prefix="memfit-bench-long-")
            try:
                manifest = encoder.embed_to(texts, out_dir, tokens=True, stride=stride)
                extra["parquet_mib"] = round(
                    sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)) / 2**20, 1
                )
                extra["manifest_counts"] = manifest.get("counts")
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)
        else:
            vectors = encoder.embed(texts, pooling="mean", stride=stride)
            if vectors.shape != (len(texts), encoder.dim) or not np.isfinite(vectors).all():
                raise RuntimeError(f"bad output {vectors.shape}")
    _measure.worker_report(
        report_path,
        seconds=round(sw.seconds, 3),
        load_seconds=round(load_sw.seconds, 3),
        rss_before_load_mib=round(rss_before_load, 1),
        rss_after_load_mib=round(rss_after_load, 1),
        texts=len(texts),
        chars=sum(map(len, texts)),
        text_tokens=text_tokens,
        model_tokens=model_tokens,
        dtype=str(encoder.dtype),
        backend=encoder.runtime.backend.name,
        max_batch_tokens=encoder.memory.batch_budget.max_batch_tokens,
        torch_threads=torch.get_num_threads(),
        **extra,
    )


# ============================================================================ parent side

COLUMNS = [
    ("method", "run", ""),
    ("texts", "texts", ","),
    ("chars", "chars", ","),
    ("text_tokens", "text tok", ","),
    ("seconds", "embed s", ".1f"),
    ("text_tokens_per_s", "text tok/s", ",.0f"),
    ("model_tokens_per_s", "model tok/s", ",.0f"),
    ("rss_after_load_mib", "RSS loaded MiB", ",.0f"),
    ("peak_rss_mib", "peak RSS MiB", ",.0f"),
    ("peak_over_loaded_mib", "peak-loaded MiB", ",.0f"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memfit long-text benchmark (not a test)")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="document sizes in characters")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--max-length", type=int, default=256, help="window size (MiniLM's own is 256)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "long.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        run_worker(args.worker, args.size, args.max_length, args.dtype, args.report)
        return 0

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    runs = [(m, s) for m in modes for s in (sizes[-1:] if m == "normal" else sizes)]

    workdir = tempfile.mkdtemp(prefix="memfit-bench-long-")
    rows = []
    for mode, size in runs:
        label = f"{mode} {size:,} chars" + (" as short texts" if mode == "normal" else "")
        report_path = os.path.join(workdir, f"{mode}-{size}.json")
        print(f"running: {label} ...", flush=True)
        report = _measure.run_in_subprocess(
            [
                sys.executable,
                __file__,
                "--worker",
                mode,
                "--size",
                str(size),
                "--max-length",
                str(args.max_length),
                "--dtype",
                args.dtype,
                "--report",
                report_path,
            ],
            report_path,
            timeout=args.timeout,
        )
        row = {"method": label, "mode": mode, "size_chars": size, **report}
        if "error" not in report:
            row["text_tokens_per_s"] = round(report["text_tokens"] / report["seconds"], 1)
            row["model_tokens_per_s"] = round(report["model_tokens"] / report["seconds"], 1)
            row["peak_over_loaded_mib"] = round(report["peak_rss_mib"] - report["rss_after_load_mib"], 1)
            print(f"  -> {report['seconds']:.1f} s, peak RSS {report['peak_rss_mib']:,.0f} MiB", flush=True)
        else:
            print(f"  -> {report['error']}", flush=True)
        rows.append(row)
    shutil.rmtree(workdir, ignore_errors=True)

    print()
    _measure.print_table(rows, COLUMNS)
    payload = {
        "benchmark": "long",
        "args": {
            "sizes": sizes,
            "modes": modes,
            "max_length": args.max_length,
            "dtype": args.dtype,
            "stride": args.max_length // 4,
            "pooling": "mean",
        },
        "corpus": "benchmarks/corpus.py:long_documents (normal: the largest one cut into ~600-char pieces)",
        "rows": rows,
    }
    print(f"\nwrote {_measure.write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
