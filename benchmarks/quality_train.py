"""Train-job quality on real data: fine-tuned MiniLM vs a linear probe on frozen embeddings vs majority class.

    python benchmarks/quality_train.py [--epochs 4] [--lr 5e-5] [--max-length 64] [--out benchmarks/results/quality_train.json]

Data: gensim's bundled movie-review polarity sentences (``pang_lee_polarity.cor``, 200 sentences,
``__label__neg`` / ``__label__pos``; Pang & Lee), shipped offline. 2-fold cross-validation with a
fixed shuffled split: every sentence is scored once by a model that did not train on it.

- fine-tune: ``memfit.train`` of the bundled all-MiniLM-L6-v2 (new classification head), batch 16,
  windows of ``--max-length`` tokens (64 holds all but the longest few sentences).
- linear probe: L2-regularised logistic regression (torch LBFGS) on frozen ``memfit.Encoder``
  mean-pooled, normalised embeddings of the same model.
- majority: the most frequent training label.
Not a test: prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure


def load_polarity() -> tuple[list[str], list[str]]:
    from gensim.test.utils import datapath

    texts, labels = [], []
    with open(datapath("pang_lee_polarity.cor"), encoding="latin-1") as f:  # one stray cp1252 byte
        for line in f:
            label, _, text = line.strip().partition(" ")
            labels.append(label.removeprefix("__label__"))
            texts.append(text)
    return texts, labels


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, l2: float = 1e-2) -> np.ndarray:
    """Multinomial logistic regression fitted by LBFGS; returns test predictions."""
    import torch

    x, y = torch.from_numpy(train_x), torch.from_numpy(train_y)
    weights = torch.zeros(x.shape[1], int(y.max()) + 1, requires_grad=True)
    bias = torch.zeros(int(y.max()) + 1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weights + bias, y) + l2 * weights.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return (torch.from_numpy(test_x) @ weights + bias).argmax(-1).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "quality_train.json"))
    args = parser.parse_args()

    from memfit import Encoder
    from memfit.training import macro_f1, train

    texts, labels = load_polarity()
    names = sorted(set(labels))
    y = np.asarray([names.index(label) for label in labels])
    order = np.random.default_rng(0).permutation(len(texts))
    folds = [order[: len(order) // 2], order[len(order) // 2:]]
    predicted = {"fine-tune": np.zeros_like(y), "linear probe": np.zeros_like(y), "majority": np.zeros_like(y)}
    embeddings = Encoder(dtype="fp32").embed(texts, normalize=True)
    seconds = 0.0
    for k, test in enumerate(folds):
        trainset = folds[1 - k]
        with tempfile.TemporaryDirectory() as root:
            data, held_out = os.path.join(root, "train.jsonl"), os.path.join(root, "test.jsonl")
            for path, idx in ((data, trainset), (held_out, test)):
                with open(path, "w") as f:
                    f.writelines(json.dumps({"text": texts[i], "label": labels[i]}) + "\n" for i in idx)
            started = time.perf_counter()
            train(data, os.path.join(root, "model"), epochs=args.epochs, lr=args.lr, batch_size=16,
                  max_length=args.max_length,
                  eval_data=held_out, echo=lambda line: print("memfit:", line, file=sys.stderr))
            seconds += time.perf_counter() - started
            from transformers import pipeline

            classify = pipeline("text-classification", model=os.path.join(root, "model"), device="cpu")
            outputs = classify([texts[i] for i in test], truncation=True, max_length=args.max_length)
            predicted["fine-tune"][test] = [names.index(p["label"]) for p in outputs]
        predicted["linear probe"][test] = linear_probe(embeddings[trainset], y[trainset], embeddings[test])
        predicted["majority"][test] = np.bincount(y[trainset]).argmax()
    rows = [{"method": method, "accuracy": float(np.mean(p == y)), "macro_f1": macro_f1(y, p)}
            for method, p in predicted.items()]
    _measure.print_table(rows, [("method", "method", ""), ("accuracy", "accuracy", ".3f"),
                                ("macro_f1", "macro-F1", ".3f")])
    load = os.getloadavg()[0]
    print(f"fine-tuning time, both folds: {seconds:.0f} s (load average {load:.1f} on {os.cpu_count()} CPUs)")
    _measure.write_json(args.out, {"benchmark": "quality_train", "data": "gensim pang_lee_polarity.cor (200)",
                                   "folds": 2, "epochs": args.epochs, "lr": args.lr, "max_length": args.max_length,
                                   "load_average": round(load, 1), "rows": rows,
                                   "fine_tune_seconds": round(seconds, 1)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
