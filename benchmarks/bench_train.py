"""Train-job benchmark: ``memfit train`` under memory budgets vs a plain transformers ``Trainer``.

    python benchmarks/bench_train.py [--examples 64] [--batch-size 32] [--max-length 512]
                                     [--methods memfit-1GiB,memfit-2GiB,memfit-4GiB,trainer-b1,trainer-b4]
                                     [--out benchmarks/results/train.json]

A bert-base-sized model (BertConfig defaults: 12 layers, hidden 768, 110M parameters) with random
weights and the bert-base-uncased vocabulary (from the bundled MiniLM), examples of random words that
fill max_length 512, effective batch 32, bf16 autocast where the CPU has it (memfit's ``auto``; the
Trainer gets ``bf16=True`` to match). ``--examples 64`` = two optimizer steps per configuration: the
AdamW moments are allocated by the first ``optimizer.step()``, so only the second step shows the
steady-state peak (a one-step run under-reports it by the moments, ~0.8 GiB on bert-base). On a 2-core
CPU one bert-base step at 512 tokens x 32 takes about a minute. Every
configuration runs in its own fresh subprocess, so its peak RSS (VmHWM) is its own; the load average
before each row is recorded (timings on a shared machine are noisy). Not a test: prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

METHODS = {
    "memfit-1GiB": "memfit train, budget 1 GiB",
    "memfit-2GiB": "memfit train, budget 2 GiB",
    "memfit-3GiB": "memfit train, budget 3 GiB",
    "memfit-4GiB": "memfit train, budget 4 GiB",
    "trainer-b1": "Trainer, micro-batch 1 x accumulation 32",
    "trainer-b1-ckpt": "Trainer, micro-batch 1 x accumulation 32, gradient checkpointing",
    "trainer-b4": "Trainer, micro-batch 4 x accumulation 8",
    "trainer-b32": "Trainer, batch 32, no accumulation",
}


def _make_model_and_data(root: str, examples: int) -> tuple[str, str]:
    """A random bert-base classifier directory and a jsonl of texts that fill 512 tokens."""
    import random

    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from memfit.engine.models import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model_dir = os.path.join(root, "bert-base-random")
    config = BertConfig(num_labels=2, id2label={0: "a", 1: "b"}, label2id={"a": 0, "b": 1})
    BertForSequenceClassification(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 3][:5000]
    rng = random.Random(0)
    data = os.path.join(root, "train.jsonl")
    with open(data, "w") as f:
        f.writelines(
            json.dumps({"text": " ".join(rng.choices(words, k=700)), "label": "ab"[i % 2]}) + "\n"
            for i in range(examples)
        )
    return model_dir, data


def _worker_memfit(budget: str, model_dir: str, data: str, out_dir: str, batch: int, max_length: int) -> dict:
    from memfit.errors import DoesNotFitError
    from memfit.training import train

    try:
        metrics = train(
            data,
            out_dir,
            model_dir,
            epochs=1,
            batch_size=batch,
            max_length=max_length,
            memory_budget=budget,
            dtype="auto",
            echo=lambda line: print("memfit:", line, file=sys.stderr),
        )
    except DoesNotFitError as exc:  # an honest row: memfit refuses before using the memory
        needed = re.search(r"(?:at least|more than) ([0-9.]+) GiB", str(exc))
        return {"does_not_fit": str(exc), "needs_gib": float(needed.group(1)) if needed else None}
    epoch = metrics["epochs"][0]
    plan = metrics["plan"]
    planned_peak = (
        plan["baseline_bytes"]
        + plan["state_bytes"]
        + plan["bytes_per_token"] * plan["micro_batch_at_longest"] * plan["longest_padded"]
    )
    return {
        "planned_peak_mib": round(planned_peak / 2**20),
        "baseline_mib": round(plan["baseline_bytes"] / 2**20),
        "seconds": epoch["seconds"],
        "examples_per_s": epoch["examples_per_s"],
        "micro_batch": plan["micro_batch_at_longest"],
        "checkpointing": plan["gradient_checkpointing"],
        "dtype": plan["dtype"],
        "budget_bytes": plan["budget_bytes"],
        "oom_events": metrics["oom_events"],
    }


def _worker_trainer(
    micro: int, checkpointing: bool, model_dir: str, data: str, out_dir: str, batch: int, max_length: int
) -> dict:
    import time

    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
    )

    from memfit.engine.models import cpu_has_fast_bf16

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(data) as f:
        rows = [json.loads(line) for line in f]
    enc = tokenizer([r["text"] for r in rows], truncation=True, max_length=max_length, padding="max_length")
    labels = [0 if r["label"] == "a" else 1 for r in rows]
    # a plain list of feature dicts is a map-style dataset for Trainer (no `datasets` dependency)
    dataset = [
        {**{k: torch.tensor(v[i]) for k, v in enc.items()}, "labels": torch.tensor(labels[i])} for i in range(len(rows))
    ]
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    bf16 = torch.cuda.is_bf16_supported() if torch.cuda.is_available() else cpu_has_fast_bf16()
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=max(1, batch // micro),
        num_train_epochs=1,
        learning_rate=2e-5,
        bf16=bf16,
        gradient_checkpointing=checkpointing,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    started = time.perf_counter()
    Trainer(model=model, args=args, train_dataset=dataset).train()
    seconds = time.perf_counter() - started
    return {
        "seconds": round(seconds, 2),
        "examples_per_s": round(len(rows) / seconds, 2),
        "micro_batch": micro,
        "checkpointing": checkpointing,
        "dtype": "bf16" if bf16 else "fp32",
    }


def _budget_gib(method: str) -> float:
    """The GiB of a ``memfit-<N>GiB`` method name (for rows refused before a plan existed); no torch
    import here, the parent process stays small."""
    return float(re.fullmatch(r"memfit-([0-9.]+)GiB", method).group(1))


def compare_with_trainer(rows: list[dict]) -> None:
    """Each memfit row that trained gets ``x_trainer_within_budget``: its speed against the fastest ``Trainer``
    row of this run whose peak stayed within that row's budget (the setting a user with that memory could pick),
    and the method it was compared with; None when no Trainer row fits."""
    trainers = [row for row in rows if row["method"].startswith("trainer-") and "examples_per_s" in row]
    for row in rows:
        if not row["method"].startswith("memfit-") or "examples_per_s" not in row:
            continue
        fitting = [t for t in trainers if t["peak_rss_mib"] * 2**20 <= row["budget_bytes"]]
        best = max(fitting, key=lambda t: t["examples_per_s"], default=None)
        row["trainer_within_budget"] = best["method"] if best else None
        row["x_trainer_within_budget"] = round(row["examples_per_s"] / best["examples_per_s"], 3) if best else None


def worker(args: argparse.Namespace) -> None:
    out_dir = tempfile.mkdtemp(prefix="memfit-bench-train-")
    if args.worker.startswith("memfit-"):
        result = _worker_memfit(
            args.worker.split("-", 1)[1],
            args.model_dir,
            args.data,
            os.path.join(out_dir, "o"),
            args.batch_size,
            args.max_length,
        )
    else:
        micro = re.fullmatch(r"trainer-b(\d+)(-ckpt)?", args.worker)
        result = _worker_trainer(
            int(micro.group(1)),
            bool(micro.group(2)),
            args.model_dir,
            args.data,
            out_dir,
            args.batch_size,
            args.max_length,
        )
    _measure.worker_report(args.report, **result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--examples",
        type=int,
        default=64,
        help="training examples (default 64 = two optimizer steps of 32: the second one runs "
        "with the AdamW moments allocated, the steady-state peak)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="effective batch (default: 32, as in the issue)")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per example (default: 512)")
    parser.add_argument(
        "--methods", default="memfit-1GiB,memfit-2GiB,memfit-3GiB,memfit-4GiB,trainer-b1,trainer-b1-ckpt,trainer-b4"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results", "train.json"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    root = tempfile.mkdtemp(prefix="memfit-bench-train-")
    setup = os.path.join(root, "setup.json")
    code = (
        f"import json, sys; sys.path.insert(0, {HERE!r}); import bench_train as b; "
        f"json.dump(b._make_model_and_data({root!r}, {args.examples}), open({setup!r}, 'w'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)  # torch stays out of this (parent) process
    with open(setup) as f:
        model_dir, data = json.load(f)
    rows = []
    for method in args.methods.split(","):
        load = round(os.getloadavg()[0], 1)
        report_path = os.path.join(root, f"{method}.json")
        report = _measure.run_in_subprocess(
            [
                sys.executable,
                __file__,
                "--worker",
                method,
                "--report",
                report_path,
                "--model-dir",
                model_dir,
                "--data",
                data,
                "--batch-size",
                str(args.batch_size),
                "--max-length",
                str(args.max_length),
            ],
            report_path,
            timeout=args.timeout,
        )
        row = {"method": method, "description": METHODS.get(method, method), "load_before": load, **report}
        if "does_not_fit" in row:
            row["result"] = f"refused: needs >= {row['needs_gib']} GiB"
        if "budget_gib" not in row and method.startswith("memfit-"):
            row["budget_gib"] = _budget_gib(method)
        if "budget_bytes" in row:
            row["budget_gib"] = round(row["budget_bytes"] / 2**30, 2)
            row["peak_within_budget"] = row["peak_rss_mib"] * 2**20 <= row["budget_bytes"]
        rows.append(row)
        print(f"{method}: {json.dumps({k: v for k, v in row.items() if k != 'description'})}", flush=True)
    compare_with_trainer(rows)
    columns = [
        ("method", "method", ""),
        ("budget_gib", "budget GiB", ".2f"),
        ("peak_rss_mib", "peak RSS MiB", ".0f"),
        ("planned_peak_mib", "planned MiB", ".0f"),
        ("peak_within_budget", "peak<=budget", ""),
        ("result", "refused", ""),
        ("micro_batch", "micro-batch", ""),
        ("checkpointing", "ckpt", ""),
        ("dtype", "dtype", ""),
        ("examples_per_s", "examples/s", ".2f"),
        ("x_trainer_within_budget", "x Trainer", ".2f"),
        ("seconds", "train s", ".1f"),
        ("load_before", "load", ".1f"),
    ]
    _measure.print_table(rows, columns)
    _measure.write_json(
        args.out,
        {
            "benchmark": "train",
            "model": "bert-base-sized, random weights",
            "max_length": args.max_length,
            "effective_batch": args.batch_size,
            "examples": args.examples,
            "cpu_count": os.cpu_count(),
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
