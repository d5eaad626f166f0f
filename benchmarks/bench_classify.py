"""Classify-job benchmark: memfit NLI zero-shot vs transformers' zero-shot pipeline (batch 1 and 32).

    python benchmarks/bench_classify.py [--n 200] [--labels 10] [--layers 6] [--hidden 384]
                                        [--max-length 256] [--methods pipe-bs1,pipe-bs32,memfit-fp32,memfit-auto]
                                        [--out benchmarks/results/classify.json]

Model: a random-weight BERT NLI classifier (3 classes: contradiction / neutral / entailment) built in a
temp dir with the bundled MiniLM tokenizer; ``--layers 12 --hidden 768`` is BERT-base, the default
(6 layers, hidden 384) is MiniLM-L6-sized so that batch size 1 finishes in minutes on 2 CPU cores.
Speed does not depend on the weights. Data: ``corpus.long_tail_corpus(n)`` (real news text, median
~150 tokens, long tail) x ``--labels`` topic labels, template "This example is {}.", single-label.
Every method runs in its own fresh subprocess (clean peak RSS); timed part = tokenization + forward +
scoring of all pairs; model load and a warm-up call are not timed. Agreement: max |score difference|
vs the pipeline (batch size 1 if run, else the first pipeline method) and top-1 agreement, from the
scores each worker saves.
Not a test: it prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

LABELS = [
    "politics",
    "sports",
    "business",
    "science",
    "health",
    "crime",
    "weather",
    "technology",
    "entertainment",
    "travel",
    "education",
    "law",
    "music",
    "religion",
    "war",
    "food",
]
TEMPLATE = "This example is {}."
REFERENCE = "pipe-bs1"
METHODS = {
    "pipe-bs1": "transformers zero-shot pipeline, batch_size=1 (its default), fp32",
    "pipe-bs32": "transformers zero-shot pipeline, batch_size=32, fp32",
    "memfit-fp32": "memfit Classifier, fp32 (backend auto: OpenVINO on the CPU)",
    "memfit-auto": "memfit Classifier, dtype auto (bf16 on CPUs with AVX-512 BF16 / AMX; backend auto)",
    "memfit-torch-fp32": "memfit Classifier, fp32, --backend torch",
    "memfit-torch-auto": "memfit Classifier, dtype auto, --backend torch",
}


# ============================================================================ worker side


def build_model(model_dir: str, layers: int, hidden: int, max_length: int) -> None:
    """Save a random-weight BERT NLI classifier with the MiniLM tokenizer into ``model_dir``."""
    import torch
    from corpus import model_path
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    tokenizer.model_max_length = max_length  # the pipeline truncates here; memfit's default follows it
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
        num_labels=3,
        id2label={0: "contradiction", 1: "neutral", 2: "entailment"},
        label2id={"contradiction": 0, "neutral": 1, "entailment": 2},
    )
    BertForSequenceClassification(config).eval().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def _loader(method: str, model_dir: str):
    if method.startswith("pipe"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

        batch_size = int(method.removeprefix("pipe-bs"))
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
        pipe = pipeline(
            "zero-shot-classification",
            model=model,
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
            device="cpu",
            batch_size=batch_size,
        )

        def classify(texts, labels):
            out = pipe(texts, candidate_labels=labels, hypothesis_template=TEMPLATE)
            return [dict(zip(r["labels"], r["scores"])) for r in out]

        return classify, {"batch_size": batch_size}
    import memfit

    memfit.configure_process("cpu")  # what the memfit command does before loading a model
    backend, _, dtype = method.removeprefix("memfit-").rpartition("-")
    clf = memfit.Classifier(model_dir, mode="nli", dtype=dtype, backend=backend or "auto", device="cpu")

    def classify(texts, labels):
        return [dict(zip(r.labels, r.scores)) for r in clf.classify(texts, labels, template=TEMPLATE)]

    return classify, {
        "dtype": clf.dtype,
        "backend": clf.runtime.backend.name,
        "max_length": clf.max_length,
        "max_batch_tokens": clf.budget.base.max_batch_tokens,
    }


def run_worker(method: str, model_dir: str, corpus_path: str, n_labels: int, scores_out: str, report_path: str) -> None:
    import numpy as np
    import torch

    with open(corpus_path) as f:
        texts = json.load(f)["texts"]
    labels = LABELS[:n_labels]
    with _measure.Stopwatch() as load_sw:
        classify, info = _loader(method, model_dir)
        classify(["A short warm-up sentence."], labels[:2])
    rss_after_load = _measure.rss_now_mib()
    with _measure.Stopwatch() as sw:
        results = classify(texts, labels)
    np.save(scores_out, np.array([[r[k] for k in labels] for r in results], dtype=np.float32))
    _measure.worker_report(
        report_path,
        seconds=round(sw.seconds, 3),
        load_seconds=round(load_sw.seconds, 3),
        rss_after_load_mib=round(rss_after_load, 1),
        torch_threads=torch.get_num_threads(),
        **info,
    )


# ============================================================================ parent side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--labels", type=int, default=10, choices=range(1, len(LABELS) + 1), metavar="K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "classify.json"))
    parser.add_argument("--worker", nargs=6, metavar=("METHOD", "MODEL", "CORPUS", "LABELS", "SCORES", "REPORT"))
    parser.add_argument("--build", nargs=4, metavar=("MODEL", "LAYERS", "HIDDEN", "MAX_LENGTH"))
    parser.add_argument("--corpus", nargs=3, metavar=("PATH", "N", "SEED"))
    args = parser.parse_args()
    if args.worker:
        method, model_dir, corpus_path, n_labels, scores_out, report = args.worker
        return run_worker(method, model_dir, corpus_path, int(n_labels), scores_out, report)
    if args.build:
        return build_model(args.build[0], *map(int, args.build[1:]))
    if args.corpus:
        import corpus

        return corpus.write_corpus(args.corpus[0], int(args.corpus[1]), int(args.corpus[2]))

    import subprocess

    import numpy as np

    methods = [m for m in args.methods.split(",") if m]
    work = tempfile.mkdtemp(prefix="memfit-bench-classify-")
    model_dir, corpus_path = os.path.join(work, "model"), os.path.join(work, "corpus.json")
    me = os.path.abspath(__file__)
    subprocess.run(
        [sys.executable, me, "--build", model_dir, str(args.layers), str(args.hidden), str(args.max_length)], check=True
    )
    subprocess.run([sys.executable, me, "--corpus", corpus_path, str(args.n), str(args.seed)], check=True)
    with open(corpus_path) as f:
        lengths = json.load(f)["lengths"]
    pairs = args.n * args.labels
    rows, scores = [], {}
    for method in methods:
        print(f"running {method} ...", file=sys.stderr, flush=True)
        score_path, report_path = os.path.join(work, f"{method}.npy"), os.path.join(work, f"{method}.json")
        report = _measure.run_in_subprocess(
            [sys.executable, me, "--worker", method, model_dir, corpus_path, str(args.labels), score_path, report_path],
            report_path,
        )
        row = {"method": method, "description": METHODS[method], "pairs": pairs, **report}
        if "error" not in report:
            row["pairs_per_s"] = round(pairs / report["seconds"], 1)
            scores[method] = np.load(score_path)
        rows.append(row)
    # agreement reference: the pipeline at batch size 1 (its default), else the first pipeline run
    reference = REFERENCE if REFERENCE in scores else next((m for m in scores if m.startswith("pipe")), None)
    ref = scores.get(reference)
    best_pipe = max((r.get("pairs_per_s", 0) for r in rows if r["method"].startswith("pipe")), default=0)
    for row in rows:
        if row["method"] in scores and ref is not None:
            row["agreement_reference"] = reference
            row["max_abs_diff_vs_pipe"] = float(np.abs(scores[row["method"]] - ref).max())
            row["top1_agreement"] = float((scores[row["method"]].argmax(1) == ref.argmax(1)).mean())
        if best_pipe and row.get("pairs_per_s"):
            row["speedup_vs_best_pipe"] = round(row["pairs_per_s"] / best_pipe, 2)
    _measure.print_table(
        rows,
        [
            ("method", "method", ""),
            ("seconds", "s", ".1f"),
            ("pairs_per_s", "pairs/s", ".1f"),
            ("speedup_vs_best_pipe", "x best pipe", ".2f"),
            ("peak_rss_mib", "peak RSS MiB", ".0f"),
            ("max_abs_diff_vs_pipe", "max |Δscore| vs pipe", ".1e"),
            ("top1_agreement", "top-1 agree", ".3f"),
        ],
    )
    _measure.write_json(
        args.out,
        {
            "benchmark": "classify",
            "texts": args.n,
            "labels": args.labels,
            "pairs": pairs,
            "model": {"layers": args.layers, "hidden": args.hidden, "max_length": args.max_length, "weights": "random"},
            "median_text_tokens": float(np.median(lengths)),
            "results": rows,
        },
    )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
