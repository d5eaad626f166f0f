"""Late vs plain chunking vs whole-document truncation, on a real retrieval task that ships offline.

    python benchmarks/bench_late_chunking.py [--model DIR] [--chunk-tokens 128] [--dtype fp32] [--out FILE]

Data: gensim's ``mini_newsgroup`` test file, 200 real Usenet posts (alt.atheism, sci.space). Each post's
``Subject:`` header, written by a person, is a query; the documents are the post bodies (the headers cut off
at the first blank line, so the ``Subject:`` line is not in the text it is matched against). Subjects are compared
without their ``Re:`` prefixes and case; every post of a subject is relevant to it (a thread's replies share
its subject), and each distinct subject is one query.

Methods, all with the bundled all-MiniLM-L6-v2 (window 256; ``--model`` for another) and mean pooling
(both all-MiniLM-L6-v2's and all-mpnet-base-v2's own), vectors L2-normalized:

- ``truncate``: one vector per document from its first window (what sentence-transformers does).
- ``plain``: each document cut into chunks of ``--chunk-tokens`` text tokens, each chunk's text embedded on
  its own (one input per chunk).
- ``late``: the same chunks, each vector the mean of the chunk's token vectors read from the document's
  windows (``Encoder.embed_tokens`` with ``long="chunk"``: every token from the window in which it is most
  central, the whole document where it fits one window), so each token was computed with its context.

A document's score for a query is its best chunk's cosine (one vector for ``truncate``). Reported:
recall@1 and recall@10 (the share of the query's relevant posts in the top 1 / 10; for recall@1, whether the
top post is relevant) and nDCG@10 (binary gains), averaged over queries, each with a 95% bootstrap interval
over queries (2,000 resamples), and the paired bootstrap intervals of late minus plain and late minus
truncate. The runs are deterministic (same inputs, same vectors: a second run gives the same figures), so
the spread that matters is over queries, not over runs.

Not a test: prints a table and writes JSON (``benchmarks/results/late_chunking.json``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
from quality_classify import _BunchAsDict  # noqa: E402

METHODS = ("truncate", "plain", "late")
RESAMPLES = 2000


def subject_queries() -> tuple[list[str], list[str], list[set[int]]]:
    """Post bodies, distinct subjects (as first written), and the posts each subject is relevant to."""
    from gensim.test.utils import datapath

    raw = zlib.decompress(open(datapath("mini_newsgroup"), "rb").read())
    posts = _BunchAsDict(io.BytesIO(raw), encoding="latin1").load()["data"]
    bodies, keys, shown = [], [], {}
    for post in posts:
        header, body = post.split("\n\n", 1)
        subject = re.search(r"^Subject:(.*)$", header, re.M).group(1).strip()
        key = re.sub(r"^(re:\s*)+", "", subject, flags=re.I).strip().lower()
        bodies.append(body)
        keys.append(key)
        shown.setdefault(key, re.sub(r"^(re:\s*)+", "", subject, flags=re.I).strip())
    queries = list(shown)
    relevant = [{d for d, k in enumerate(keys) if k == q} for q in queries]
    return bodies, [shown[q] for q in queries], relevant


def chunks_of(token_offsets: np.ndarray, chunk_tokens: int) -> list[tuple[int, int]]:
    """Token spans ``[start, end)`` of consecutive chunks of ``chunk_tokens`` text tokens."""
    n = len(token_offsets)
    return [(s, min(s + chunk_tokens, n)) for s in range(0, max(n, 1), chunk_tokens)]


def chunk_vectors(encoder, bodies: list[str], chunk_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document of each chunk, late vectors, plain vectors), chunks in document order."""
    tokens = encoder.embed_tokens(bodies, drop_special=True, long="chunk")
    owner, late, texts = [], [], []
    for doc, (body, t) in enumerate(zip(bodies, tokens)):
        for start, end in chunks_of(t.offsets, chunk_tokens):
            owner.append(doc)
            late.append(t.embeddings[start:end].astype(np.float64).mean(axis=0))
            texts.append(body[t.offsets[start, 0] : t.offsets[end - 1, 1]])
    plain = encoder.embed(texts, normalize=True, long="chunk")
    return np.array(owner), _normalized(np.array(late)), plain


def _normalized(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def document_scores(queries: np.ndarray, vectors: np.ndarray, owner: np.ndarray, n_docs: int) -> np.ndarray:
    """``[queries, documents]``: each document's best chunk cosine."""
    sims = queries @ vectors.T
    scores = np.full((len(queries), n_docs), -np.inf)
    np.maximum.at(scores.T, owner, sims.T)
    return scores


def per_query_metrics(scores: np.ndarray, relevant: list[set[int]]) -> dict[str, np.ndarray]:
    """recall@1, recall@10, nDCG@10 per query (binary relevance)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    r1, r10, ndcg = [], [], []
    discounts = 1.0 / np.log2(np.arange(2, 12))
    for ranked, rel in zip(order, relevant):
        hits = np.array([d in rel for d in ranked[:10]], dtype=float)
        r1.append(hits[0])
        r10.append(hits.sum() / len(rel))
        ideal = discounts[: min(len(rel), 10)].sum()
        ndcg.append((hits * discounts).sum() / ideal)
    return {"recall@1": np.array(r1), "recall@10": np.array(r10), "nDCG@10": np.array(ndcg)}


def bootstrap(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile interval of the mean over queries."""
    picks = rng.integers(0, len(values), size=(RESAMPLES, len(values)))
    means = values[picks].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def main() -> None:
    ap = argparse.ArgumentParser(description="late vs plain chunking vs truncation on newsgroup subjects")
    ap.add_argument("--model", default=None, help="model directory (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32", help="fp32 (default: no reduced-precision noise in the comparison)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "late_chunking.json"))
    args = ap.parse_args()

    import memfit

    memfit.configure_process("cpu")
    encoder = memfit.Encoder(args.model, dtype=args.dtype)
    bodies, queries, relevant = subject_queries()
    q = encoder.embed(queries, normalize=True)
    owner, late, plain = chunk_vectors(encoder, bodies, args.chunk_tokens)
    truncate = encoder.embed(bodies, normalize=True, long="truncate")
    n = len(bodies)
    vectors = {
        "truncate": (truncate, np.arange(n)),
        "plain": (plain, owner),
        "late": (late, owner),
    }
    metrics = {m: per_query_metrics(document_scores(q, v, o, n), relevant) for m, (v, o) in vectors.items()}
    rng = np.random.default_rng(0)
    rows = []
    for m in METHODS:
        row = {"method": m}
        for name, values in metrics[m].items():
            row[name] = float(values.mean())
            row[name + " CI95"] = bootstrap(values, rng)
        rows.append(row)
    # paired: the same resampled queries for both methods, so the spread of the difference is the difference's own
    diffs = {
        f"late - {other}": {
            name: bootstrap(metrics["late"][name] - metrics[other][name], rng) for name in metrics[other]
        }
        for other in ("plain", "truncate")
    }
    room = encoder.max_length - encoder.special.single_overhead  # text tokens per window
    tokens = [len(t) for t in encoder.tokenizer(bodies, add_special_tokens=False)["input_ids"]]

    print(
        f"{len(queries)} queries, {n} documents ({np.median(tokens):.0f} tokens median, "
        f"{sum(t > room for t in tokens)} over one window), {len(owner)} chunks of {args.chunk_tokens} tokens"
    )
    print(f"{'method':<10}" + "".join(f"{k:>26}" for k in metrics["late"]))
    for row in rows:
        cells = "".join(
            f"{row[k]:>10.3f} [{row[k + ' CI95'][0]:.3f}, {row[k + ' CI95'][1]:.3f}]" for k in metrics["late"]
        )
        print(f"{row['method']:<10}{cells}")
    for label, diff in diffs.items():
        print(
            f"{label}, 95% paired bootstrap: "
            + ", ".join(f"{k} [{lo:+.3f}, {hi:+.3f}]" for k, (lo, hi) in diff.items())
        )
    payload = {
        "machine": _measure.machine_facts(),
        "model": encoder.model_name,
        "dtype": encoder.dtype,
        "max_length": encoder.max_length,
        "chunk_tokens": args.chunk_tokens,
        "queries": len(queries),
        "documents": n,
        "chunks": len(owner),
        "document_tokens_median": float(np.median(tokens)),
        "rows": rows,
        "differences_CI95": diffs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(payload, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
