"""Quality of zero-shot classification in embedding mode, on real labelled data that ships offline.

    python benchmarks/quality_classify.py [--dtype auto] [--out benchmarks/results/quality_classify.json]

Data (gensim's test data, no download):

- ``mini_newsgroup``: 200 Usenet posts, 100 alt.atheism + 100 sci.space (a pickled scikit-learn
  ``Bunch``). The mail headers name the newsgroup ("Newsgroups: alt.atheism"), so they are cut off at
  the first blank line and only the body is classified.
- ``pang_lee_polarity.cor``: 200 movie-review sentences, ``__label__pos`` / ``__label__neg`` (latin-1).

Model: the bundled all-MiniLM-L6-v2 through :class:`memfit.Classifier` (embedding mode), with fixed
label names and templates (written below, not tuned on the data). Reports accuracy against the
majority-class baseline for ``long="truncate"`` and ``"chunk"``, the log-loss of the softmax scores
for a grid of temperatures (how :data:`memfit.jobs.classify.DEFAULT_TEMPERATURE` was chosen; accuracy does
not depend on it), and the per-(text, label) accuracy of the multi-label threshold for a grid of
similarity thresholds (how ``DEFAULT_SIMILARITY_THRESHOLD`` was chosen).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

TEMPERATURES = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2)
THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4)


class _BunchAsDict(pickle.Unpickler):
    """Unpickle scikit-learn's ``Bunch`` as a plain dict, so scikit-learn is not needed."""

    def find_class(self, module: str, name: str):
        if module.startswith("sklearn"):
            return dict
        return super().find_class(module, name)


def newsgroups() -> dict:
    from gensim.test.utils import datapath

    raw = zlib.decompress(open(datapath("mini_newsgroup"), "rb").read())
    bunch = _BunchAsDict(io.BytesIO(raw), encoding="latin1").load()
    bodies = [post.split("\n\n", 1)[1] if "\n\n" in post else post for post in bunch["data"]]
    names = {"alt.atheism": "atheism", "sci.space": "space"}
    return {
        "name": "mini_newsgroup (alt.atheism vs sci.space)",
        "texts": bodies,
        "gold": [names[bunch["target_names"][t]] for t in bunch["target"]],
        "labels": ["atheism", "space"],
        "template": "This text is about {}.",
    }


def polarity() -> dict:
    from gensim.test.utils import datapath

    texts, gold = [], []
    for line in open(datapath("pang_lee_polarity.cor"), encoding="latin-1"):
        if line.strip():
            tag, text = line.split(" ", 1)
            texts.append(text.strip())
            gold.append({"__label__pos": "positive", "__label__neg": "negative"}[tag])
    return {
        "name": "pang_lee_polarity (movie-review sentences)",
        "texts": texts,
        "gold": gold,
        "labels": ["negative", "positive"],
        "template": "This movie review is {}.",
    }


def evaluate(clf, data: dict, long: str) -> dict:
    from memfit.jobs.classify import embedding_scores

    texts, labels, gold = data["texts"], data["labels"], np.array(data["gold"])
    results = clf.classify(texts, labels, template=data["template"], long=long)
    predicted = np.array([r.labels[0] for r in results])
    majority = max(set(gold.tolist()), key=gold.tolist().count)
    row = {
        "dataset": data["name"],
        "texts": len(texts),
        "long": long,
        "dtype": clf.dtype,
        "accuracy": float((predicted == gold).mean()),
        "majority_baseline": float((gold == majority).mean()),
    }
    # the cosines behind the scores, to sweep temperature and threshold
    encoder = clf.encoder
    text_vectors = encoder.embed(texts, normalize=True, long=long)
    label_vectors = encoder.embed([data["template"].format(x) for x in labels], normalize=True, long="truncate")
    cosine = text_vectors.astype(np.float64) @ label_vectors.T.astype(np.float64)
    truth = np.array([[g == label for label in labels] for g in gold])
    row["log_loss_by_temperature"] = {
        t: float(-np.log(np.clip(embedding_scores(cosine, t, 0.0, False)[truth], 1e-12, 1)).mean())
        for t in TEMPERATURES
    }
    row["multilabel_pair_accuracy_by_threshold"] = {th: float(((cosine > th) == truth).mean()) for th in THRESHOLDS}
    row["cosine_true_label_mean"] = float(cosine[truth].mean())
    row["cosine_other_label_mean"] = float(cosine[~truth].mean())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "quality_classify.json"))
    args = parser.parse_args()
    import memfit

    clf = memfit.Classifier(dtype=args.dtype)
    rows = [evaluate(clf, data, long) for data in (newsgroups(), polarity()) for long in ("truncate", "chunk")]
    _measure.print_table(
        rows,
        [
            ("dataset", "dataset", ""),
            ("long", "long", ""),
            ("dtype", "dtype", ""),
            ("accuracy", "accuracy", ".3f"),
            ("majority_baseline", "majority", ".3f"),
        ],
    )
    print("\nlog-loss by temperature (lower is better):")
    for row in rows:
        print(
            f"  {row['dataset'][:28]:28s} {row['long']:8s} "
            + "  ".join(f"{t}:{v:.3f}" for t, v in row["log_loss_by_temperature"].items())
        )
    print("multi-label (text, label) accuracy by cosine threshold:")
    for row in rows:
        print(
            f"  {row['dataset'][:28]:28s} {row['long']:8s} "
            + "  ".join(f"{t}:{v:.3f}" for t, v in row["multilabel_pair_accuracy_by_threshold"].items())
        )
    _measure.write_json(
        args.out, {"benchmark": "quality_classify", "model": "all-MiniLM-L6-v2 (bundled)", "results": rows}
    )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
