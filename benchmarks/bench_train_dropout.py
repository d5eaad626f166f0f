"""What keyed dropout masks cost in training speed: memfit's seeded dropout (hidden dropout keyed by
example, attention-probability dropout off) vs torch's own ``nn.Dropout`` and attention dropout.

    python benchmarks/bench_train_dropout.py [--repeats 2] [--out benchmarks/results/train_dropout.json]

The bundled all-MiniLM-L6-v2 fine-tuned by ``memfit.train`` for one epoch on 134 of gensim's polarity
sentences (max_length 64, batch 16, fp32, no budget), each run in a fresh subprocess, the two variants
alternating; the figure is the epoch's examples/s from ``metrics.json`` (steps only: calibration and the
probe pass are outside it). Not a test: prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
from quality_classify import polarity  # noqa: E402

VARIANTS = {
    "seeded": "memfit's keyed masks, attention dropout off",
    "torch": "torch's nn.Dropout and attention dropout (the global RNG)",
}


def worker(variant: str, data: str, out: str) -> None:
    import memfit.training.api as api

    if variant == "torch":
        api.install_seeded_dropout = lambda model, seed, inputs: None
    metrics = api.train(data, out, max_length=64, epochs=1, batch_size=16, dtype="fp32")
    print(
        json.dumps(
            {
                "examples_per_s": metrics["epochs"][0]["examples_per_s"],
                "bytes_per_token": metrics["plan"]["bytes_per_token"],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "train_dropout.json"))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    texts = polarity()
    rows_by_variant: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as root:
        data = os.path.join(root, "train.jsonl")
        with open(data, "w") as f:
            f.writelines(
                json.dumps({"text": t, "label": g}) + "\n" for t, g in list(zip(texts["texts"], texts["gold"]))[:134]
            )
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                out = os.path.join(root, f"{variant}-{repeat}")
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", variant, data, out],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["load_average"] = round(os.getloadavg()[0], 1)
                rows_by_variant[variant].append(row)
                print(variant, row, flush=True)
    rows = [
        {
            "variant": v,
            "description": VARIANTS[v],
            "examples_per_s": [r["examples_per_s"] for r in runs],
            "activation_kib_per_token": round(runs[0]["bytes_per_token"] / 1024, 1),
            "load_average": [r["load_average"] for r in runs],
        }
        for v, runs in rows_by_variant.items()
    ]
    _measure.print_table(
        rows,
        [
            ("variant", "variant", ""),
            ("examples_per_s", "examples/s per run", ""),
            ("activation_kib_per_token", "planned KiB/token", ""),
            ("load_average", "load", ""),
        ],
    )
    _measure.write_json(args.out, {"benchmark": "train_dropout", "model": "all-MiniLM-L6-v2 (bundled)", "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
