"""Precision benchmark: speed, memory and quality of each dtype / quantize choice vs fp32.

    python benchmarks/bench_precision.py [--n 600] [--seed 0] [--max-length 512]
                                         [--task-max-length 128] [--methods fp32,auto,bf16,fp16,int8]
                                         [--out benchmarks/results/precision.json]

Every method runs in its own fresh subprocess (clean peak RSS) on the same data:

* speed: ``Encoder.embed`` over ``corpus.long_tail_corpus(n, seed)`` truncated to ``--max-length``
  (timed: tokenization + forward + pooling; model load and a warm-up call are not timed), real
  (non-padding) tokens per second; peak RSS right after the timed run;
* agreement with fp32: min / mean / p1 cosine of each text's embedding vs the fp32 method's;
* the quality guard's own cost and figure on the first 64 texts (``precision.measure_quality``);
* task quality on real labelled data shipped with gensim: Lee corpus document similarity (Pearson
  correlation of the 1,225 pairwise cosines with the human scores in ``similarities0-1.txt``, the
  Lee, Pincombe & Welsh 2005 ratings of ``lee.cor``), and leave-one-out 5-NN accuracy on
  ``pang_lee_polarity.cor`` (200 movie-review sentences, pos/neg) and ``mini_newsgroup``
  (200 posts, alt.atheism vs sci.space, headers stripped so the label is not in the text); task texts
  are truncated to ``--task-max-length`` tokens to keep the run short on 2 cores.

Not a test: it prints a table and writes JSON (gitignored ``benchmarks/results/``). Timings on a shared
machine are noisy; the JSON records the machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import sys
import tempfile
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

# key -> (label, Encoder keyword arguments)
METHODS: dict[str, tuple[str, dict]] = {
    "fp32": ("fp32", {"dtype": "fp32"}),
    "auto": ("--dtype auto", {"dtype": "auto"}),
    "bf16": ("bf16", {"dtype": "bf16"}),
    "fp16": ("fp16", {"dtype": "fp16"}),
    "int8": ("int8 (per-channel, FFN output kept fp32)", {"quantize": "int8"}),
}
REFERENCE = "fp32"
WARMUP_TEXTS = ["A short warm-up sentence.", "Another one, slightly longer than the first."]
GUARD_TEXTS = 64


# ============================================================================ real labelled data


def _gensim_path(name: str) -> str:
    from gensim.test.utils import datapath

    return datapath(name)


def _gensim_file(name: str) -> bytes:
    with open(_gensim_path(name), "rb") as f:
        return f.read()


def lee_documents() -> tuple[list[str], np.ndarray]:
    """The 50 ``lee.cor`` documents and the upper triangle of their human similarity matrix."""
    docs = [" ".join(line.split()) for line in _gensim_file("lee.cor").decode("latin-1").splitlines()]
    human = np.loadtxt(_gensim_path("similarities0-1.txt"))
    return docs, human[np.triu_indices(len(human), 1)]


def polarity() -> tuple[list[str], np.ndarray]:
    """200 movie-review sentences, label 1 = positive."""
    texts, labels = [], []
    for line in _gensim_file("pang_lee_polarity.cor").decode("cp1252", errors="replace").splitlines():
        label, _, text = line.partition(" ")
        texts.append(text.strip())
        labels.append(int(label == "__label__pos"))
    return texts, np.array(labels)


def newsgroups() -> tuple[list[str], np.ndarray]:
    """200 posts (alt.atheism / sci.space), message headers removed: they name the newsgroup."""

    class Bunch(dict):
        def __setstate__(self, state: dict) -> None:
            self.update(state)

    class Unpickler(pickle.Unpickler):  # a Python 2 pickle of a scikit-learn Bunch
        def find_class(self, module: str, name: str):
            return Bunch if name == "Bunch" else super().find_class(module, name)

    bunch = Unpickler(io.BytesIO(zlib.decompress(_gensim_file("mini_newsgroup"))), encoding="latin1").load()
    bodies = [text.split("\n\n", 1)[-1].strip() for text in bunch["data"]]
    return bodies, np.asarray(bunch["target"])


# ============================================================================ worker side


def worker(
    method: str, n: int, seed: int, max_length: int, task_max_length: int, report_path: str, emb_path: str
) -> None:
    from corpus import long_tail_corpus, token_lengths

    import dataclasses

    from memfit import Encoder, configure_process

    configure_process("cpu")  # what the memfit command does before loading a model
    texts = long_tail_corpus(n, seed)
    real_tokens = sum(min(x, max_length) for x in token_lengths(texts))
    with _measure.Stopwatch() as load:
        enc = Encoder(max_length=max_length, quality_check=False, **METHODS[method][1])
        enc.embed(WARMUP_TEXTS)
    with _measure.Stopwatch() as run:
        corpus_emb = enc.embed(texts, long="truncate")
    run_peak = _measure.peak_rss()["peak_rss_mib"]

    guard = None
    if method != REFERENCE:
        with _measure.Stopwatch() as guard_time:
            report = enc.measure_quality(texts[:GUARD_TEXTS], enc.default_pooling, threshold=0.0)
        guard = {
            "seconds": round(guard_time.seconds, 2),
            "min_cosine": report.min_cosine,
            "mean_cosine": report.mean_cosine,
            "tokens": report.tokens,
        }
    lee_docs, _ = lee_documents()
    # the window size of the task runs only; the timed run is done
    enc = Encoder(runtime=dataclasses.replace(enc.runtime, max_length=task_max_length), quality_check=False)

    def embed_task(texts: list[str]) -> np.ndarray:
        return enc.embed(texts, long="truncate")

    np.savez(
        emb_path,
        corpus=corpus_emb,
        lee=embed_task(lee_docs),
        polarity=embed_task(polarity()[0]),
        newsgroups=embed_task(newsgroups()[0]),
    )
    _measure.worker_report(
        report_path,
        seconds=run.seconds,
        load_s=round(load.seconds, 2),
        texts=len(texts),
        real_tokens=real_tokens,
        dtype=enc.dtype,
        quantize=enc.quantize,
        run_peak_rss_mib=run_peak,
        guard=guard,
    )


# ============================================================================ parent side


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def knn_accuracy(emb: np.ndarray, labels: np.ndarray, k: int = 5) -> float:
    """Leave-one-out k-nearest-neighbour accuracy with cosine similarity (majority vote)."""
    unit = _unit(emb)
    sims = unit @ unit.T
    np.fill_diagonal(sims, -np.inf)
    neighbours = np.argsort(-sims, axis=1)[:, :k]
    votes = labels[neighbours].mean(axis=1)
    return float(((votes > 0.5).astype(int) == labels).mean())


def lee_correlation(emb: np.ndarray, human: np.ndarray) -> float:
    unit = _unit(emb)
    sims = (unit @ unit.T)[np.triu_indices(len(unit), 1)]
    return float(np.corrcoef(sims, human)[0, 1])


def quality_row(emb: dict, ref: dict | None) -> dict:
    _, human = lee_documents()
    row = {
        "lee_pearson": round(lee_correlation(emb["lee"], human), 4),
        "polarity_5nn": round(knn_accuracy(emb["polarity"], polarity()[1]), 4),
        "newsgroups_5nn": round(knn_accuracy(emb["newsgroups"], newsgroups()[1]), 4),
    }
    if ref is not None:
        cos = (_unit(emb["corpus"]) * _unit(ref["corpus"])).sum(axis=1)
        row.update(
            cos_min=round(float(cos.min()), 5),
            cos_mean=round(float(cos.mean()), 6),
            cos_p1=round(float(np.percentile(cos, 1)), 5),
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--task-max-length", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "precision.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--report", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--emb", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.n, args.seed, args.max_length, args.task_max_length, args.report, args.emb)
        return

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if REFERENCE not in methods:
        methods.insert(0, REFERENCE)
    rows, embeddings = [], {}
    with tempfile.TemporaryDirectory(prefix="memfit-bench-precision-") as tmp:
        for method in methods:
            report_path, emb_path = os.path.join(tmp, f"{method}.json"), os.path.join(tmp, f"{method}.npz")
            argv = [
                sys.executable,
                __file__,
                "--worker",
                method,
                "--n",
                str(args.n),
                "--seed",
                str(args.seed),
                "--max-length",
                str(args.max_length),
                "--task-max-length",
                str(args.task_max_length),
                "--report",
                report_path,
                "--emb",
                emb_path,
            ]
            report = _measure.run_in_subprocess(argv, report_path, timeout=1800)
            row = {"method": METHODS[method][0], "key": method}
            if "error" in report:
                rows.append({**row, **report})
                continue
            row = _measure.throughput_row(
                METHODS[method][0],
                report,
                texts=report["texts"],
                real_tokens=report["real_tokens"],
                total_tokens=report["real_tokens"],
            )
            row["key"] = method
            with np.load(emb_path) as data:
                embeddings[method] = {k: data[k] for k in data.files}
            row.update(quality_row(embeddings[method], embeddings.get(REFERENCE) if method != REFERENCE else None))
            if report.get("guard"):
                row["guard_s"], row["guard_min_cos"] = report["guard"]["seconds"], report["guard"]["min_cosine"]
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)

    columns = [
        ("method", "method", ""),
        ("dtype", "dtype", ""),
        ("tokens_per_s", "tok/s", ",.0f"),
        ("run_peak_rss_mib", "peak RSS MiB", ",.0f"),
        ("cos_min", "cos min", ".5f"),
        ("cos_mean", "cos mean", ".6f"),
        ("cos_p1", "cos p1", ".5f"),
        ("guard_s", "guard s", ".1f"),
        ("guard_min_cos", "guard min", ".5f"),
        ("lee_pearson", "Lee r", ".4f"),
        ("polarity_5nn", "polarity 5NN", ".3f"),
        ("newsgroups_5nn", "news 5NN", ".3f"),
    ]
    print(f"\nall-MiniLM-L6-v2, {args.n} long-tail texts truncated to {args.max_length} tokens, CPU")
    _measure.print_table(rows, columns)
    path = _measure.write_json(
        args.out,
        {
            "benchmark": "precision",
            "n": args.n,
            "seed": args.seed,
            "max_length": args.max_length,
            "task_max_length": args.task_max_length,
            "rows": rows,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
