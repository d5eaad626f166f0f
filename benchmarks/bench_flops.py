"""How close to the hardware: FLOP/s of each bare runtime and of memfit, against the CPU's dense matrix-product rate.

    python benchmarks/bench_flops.py [--models minilm,/path/to/all-mpnet-base-v2] [--n 2000] [--n-large 600]
                                     [--rounds 3] [--precisions fp32,bf16] [--out benchmarks/results/flops.json]

Issue 32 asks for FLOP/s against the CPU's fp32 peak for MiniLM and MPNet on each CPU kind, and where the fastest
bare runtime falls below ~75% of it, for where the time goes. In one process, on real short texts (gensim's
movie-review sentences, as ``bench_backends.py``; window 256), tokenized once and cut into length-sorted batches of
32 padded to their longest:

- **bare** rows time the forwards alone: memfit's own compiled OpenVINO graph and ONNX Runtime session in fp32
  (the objects memfit runs, called directly) and a transformers ``AutoModel`` forward in fp32;
- **memfit** rows time ``Encoder.embed`` end to end (tokenizing, batching, pooling): what a user gets.

Useful FLOPs count each text's own tokens, no padding: per layer ``(8 h^2 + 4 h i) x tokens`` in the linear layers
and ``4 h x tokens^2`` in attention (h: hidden size, i: intermediate size), twice a multiply-add. The ceiling is
the fastest rate a large fp32 matrix product reaches on the same threads (2,048^3, best of ten, through PyTorch and
through OpenVINO): what this CPU sustains, not a data-sheet figure. Each row is the median of ``--rounds``
alternated rounds. Models larger than MiniLM get ``--n-large`` texts. Not a test: it prints a table and writes JSON.

``--precisions fp32,bf16`` adds the bf16 rows: OpenVINO's graph compiled in bf16 (what ``auto`` runs where the CPU
has fast bf16), memfit on it, and a transformers forward in bfloat16, against the same matrix product's bf16 rate
(PyTorch on bfloat16 tensors, OpenVINO with a bf16 precision hint). On a CPU with AMX that rate is several times the
fp32 one, and the rows say how much of it an encoder's short-text forwards reach.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
from bench_backends import texts_for  # noqa: E402

WINDOW = 256
BATCH = 32
GEMM_SIZE = 2048
COLUMNS = [
    ("model", "model", ""),
    ("method", "method", ""),
    ("texts_per_s", "texts/s", ".1f"),
    ("tokens_per_s", "tokens/s", ",.0f"),
    ("gflops", "GFLOP/s", ".1f"),
    ("of_gemm", "of the GEMM rate", ".0%"),
]


def _best_seconds(call: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, after one untimed: a rate's best is the hardware's, its noise the
    host's."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_gflops(precision: str = "fp32", size: int = GEMM_SIZE, repeats: int = 10) -> dict[str, float]:
    """The best rate of a ``size``-cubed matrix product in ``precision`` (fp32 or bf16) on this process's threads, in
    GFLOP/s, through PyTorch and through OpenVINO (their kernels differ: OpenVINO's fp32 reached 189.6 against
    PyTorch's 180.2 on the AVX-512 EPYC); the larger is the ceiling."""
    import numpy as np
    import openvino
    import openvino.opset13 as ops
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a_typed, b_typed = (a.bfloat16(), b.bfloat16()) if precision == "bf16" else (a, b)
    rates = {"torch": 2 * size**3 / _best_seconds(lambda: torch.matmul(a_typed, b_typed), repeats) / 1e9}
    x = ops.parameter([size, size], np.float32, name="x")
    product = ops.matmul(x, ops.constant(b.numpy()), False, False)
    config = {
        "INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32",
        "INFERENCE_NUM_THREADS": torch.get_num_threads(),
        "NUM_STREAMS": 1,
    }
    request = openvino.Core().compile_model(openvino.Model([product], [x]), "CPU", config).create_infer_request()
    rates["openvino"] = 2 * size**3 / _best_seconds(lambda: request.infer({0: a.numpy()}), repeats) / 1e9
    return rates


def useful_flops(config: Any, lengths: list[int]) -> float:
    """Multiply-adds x 2 of the encoder layers over texts of ``lengths`` tokens each, padding not counted."""
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    linear = 2 * (4 * hidden * hidden + 2 * hidden * inner)  # Q, K, V, output; the two feed-forward products
    attention = 2 * 2 * hidden  # scores and the weighted sum, per token pair
    return float(sum(layers * (linear * n + attention * n * n) for n in lengths))


def runners(
    model: str, texts: list[str], precision: str = "fp32"
) -> tuple[dict[str, Callable[[], None]], Any, list[int]]:
    """The timed calls for one model in ``precision``, its config and every text's token count (ONNX Runtime only in
    fp32: memfit runs it in no other precision)."""
    import torch
    from transformers import AutoModel

    import memfit

    encoders = {"openvino": memfit.Encoder(model, max_length=WINDOW, backend="openvino", dtype=precision)}
    if precision == "fp32" and importlib.util.find_spec("onnxruntime") is not None:
        encoders["onnxruntime"] = memfit.Encoder(model, max_length=WINDOW, backend="onnxruntime", dtype="fp32")
    first = encoders["openvino"]
    ids = first.tokenizer(texts, truncation=True, max_length=WINDOW)["input_ids"]
    batches = [feed for _, feed in _measure.length_sorted_batches(ids, BATCH)]
    lengths = [len(row) for row in ids]
    torch_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    reference = AutoModel.from_pretrained(model, dtype=torch_dtype).eval()
    torch_batches = [{k: torch.from_numpy(v) for k, v in batch.items()} for batch in batches]

    with torch.inference_mode():
        reference(**torch_batches[-1])  # warm-up: the longest batch's buffers and kernels

    def bare_torch() -> None:
        with torch.inference_mode():
            for batch in torch_batches:
                reference(**batch)

    calls: dict[str, Callable[[], None]] = {f"bare transformers {precision}": bare_torch}
    for name, encoder in encoders.items():
        encoder.embed(texts[:64], long="truncate")  # warm-up: the runtime's first shapes
        backend = encoder.runtime.backend
        infer = backend.graph.infer if name == "openvino" else backend.session.run  # memfit's objects, as they run

        def bare(infer=infer) -> None:
            for batch in batches:
                infer(batch)

        calls[f"bare {name} {precision}"] = bare
        calls[f"memfit embed, {name} {precision}"] = lambda e=encoder: e.embed(texts, long="truncate")
    return calls, reference.config, lengths


def measure(
    model: str, label: str, texts: list[str], rounds: int, ceiling: float, precision: str = "fp32"
) -> list[dict]:
    """One model's rows in one precision: each call timed once a round, rounds alternated, the median kept (the
    host's pace moves over minutes, so no row gets the fast or slow minutes alone)."""
    calls, config, lengths = runners(model, texts, precision)
    flops = useful_flops(config, lengths)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    rows = []
    for name, runs in seconds.items():
        median = statistics.median(runs)
        gflops = flops / median / 1e9
        rows.append(
            {
                "row": f"{label}, {name}",  # what the runner's scenario picks a row by
                "model": label,
                "method": name,
                "precision": precision,
                "texts_per_s": len(texts) / median,
                "tokens_per_s": sum(lengths) / median,
                "gflops": gflops,
                "of_gemm": gflops / ceiling,
                "runs_s": [round(r, 3) for r in runs],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="FLOP/s against the CPU's dense matrix-product rate (not a test)")
    parser.add_argument("--models", default="minilm", help="comma-separated: 'minilm' (the bundled one) or paths")
    parser.add_argument("--n", type=int, default=2000, help="texts for MiniLM-sized models")
    parser.add_argument("--n-large", type=int, default=600, help="texts for larger models (hidden size > 384)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", default="fp32", help="comma-separated: fp32, bf16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    import memfit
    from memfit.engine.models import default_model_path

    memfit.configure_process("cpu")
    precisions = args.precisions.split(",")
    before = {precision: gemm_gflops(precision) for precision in precisions}
    for precision, rates in before.items():
        print(
            f"dense {precision} matrix product ({GEMM_SIZE}^3): " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
        )
    rows = []
    for precision in precisions:
        for model in args.models.split(","):
            path = default_model_path() if model == "minilm" else model
            label = "all-MiniLM-L6-v2" if model == "minilm" else os.path.basename(model.rstrip("/"))
            large = AutoConfig.from_pretrained(path).hidden_size > 384
            texts, _ = texts_for("short", args.n_large if large else args.n)
            rows += measure(path, label, texts, args.rounds, max(before[precision].values()), precision)
    after = {precision: gemm_gflops(precision) for precision in precisions}  # the host's pace can move in a run
    for precision, rates in after.items():
        print(f"the same after the rows, {precision}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    _measure.print_table(rows, COLUMNS)
    payload = {"gemm_gflops": {"before": before, "after": after}, "rows": rows}
    if args.out:
        print("wrote", _measure.write_json(args.out, payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
