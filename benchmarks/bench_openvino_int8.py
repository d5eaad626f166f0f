"""Selective int8 on the compiled runtime: which layers can stay int8 for a min cosine >= 0.99 at >= 2.5x fp32?

    python benchmarks/bench_openvino_int8.py [--n 2000] [--rounds 3] [--calibration 300] [--out FILE]

Needs NNCF (``pip install nncf -c constraints.txt``; not a memfit dependency): NNCF's post-training
quantization (``nncf.quantize``, ``ModelType.TRANSFORMER``: int8 weights per channel, int8 activations
calibrated on real text) is applied to the same OpenVINO graph memfit compiles
(``memfit.engine.openvino.conversion.convert`` of all-MiniLM-L6-v2), with layers left out of it through
``nncf.IgnoredScope``:

- ``int8-all``: every MatMul int8;
- ``int8-keep-ffn-out``: the FFN output projections (``layer.N.output.dense``, whose inputs are the GELU's
  long-tailed activations) stay in the float precision;
- ``int8-keep-ffn-out-last``: those, and the whole last layer;
- ``int8-keep-ffn``: both FFN projections of every layer float (only attention's projections int8);
- ``int8-keep-first-ffn-out`` / ``-last-ffn-out`` / ``-first-last-ffn-out``: the FFN output projection of the first,
  the last, or both layers float;
- ``int8-all-mixed``: every MatMul int8, NNCF's ``mixed`` preset (asymmetric activations) instead of
  ``performance`` (symmetric);
- ``int8-weights-only``: ``nncf.compress_weights`` (int8 weights, asymmetric, no calibration data), the
  activations in the float precision.

Each int8 graph is compiled twice: with the rest in fp32, and in bf16 (``INFERENCE_PRECISION_HINT``) where the
CPU has it. Calibration texts: sentences of gensim's ``lee_background.cor`` (news), never the evaluation texts, or
with ``--calibration-source random`` sequences of random ordinary tokens (no text at all).

Speed: texts/s in-process, the graph alone on length-sorted batches of 32 (tokenize, pad, infer, mean-pool),
over gensim's 200 movie-review sentences repeated to ``--n`` (the texts of bench_backends' ``short`` row), median
of ``--rounds`` alternated rounds. Quality: per-text cosine of the pooled vector against the fp32 graph's, on the
200 reviews and on 300 texts of ``corpus.long_tail_corpus`` (truncated at 256 tokens); min and p1.

Not a test: prints a table and writes JSON (``benchmarks/results/openvino-int8.json``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
import corpus  # noqa: E402
from bench_serve import short_texts  # noqa: E402

WINDOW = 256
BATCH = 32
FFN_OUT = r".*layer\.\d+\.output\.dense.*"
FFN_IN = r".*layer\.\d+\.intermediate\.dense.*"

FFN_OUT_OF = r".*layer\.{layer}\.output\.dense.*"

# name -> (patterns of the ops left in float, NNCF preset); None: no int8. {last}: the last layer's number.
VARIANTS: dict[str, tuple[list[str], str] | None] = {
    "fp32 (no int8)": None,
    "int8-all": ([], "performance"),
    "int8-all-mixed": ([], "mixed"),
    "int8-weights-only": ([], "weights"),
    "int8-keep-ffn-out": ([FFN_OUT], "performance"),
    "int8-keep-ffn-out-last": ([FFN_OUT, r".*layer\.{last}\..*"], "performance"),
    "int8-keep-ffn": ([FFN_OUT, FFN_IN], "performance"),
    "int8-keep-first-ffn-out": ([FFN_OUT_OF.replace("{layer}", "0")], "performance"),
    "int8-keep-last-ffn-out": ([FFN_OUT_OF.replace("{layer}", "{last}")], "performance"),
    "int8-keep-first-last-ffn-out": (
        [FFN_OUT_OF.replace("{layer}", "0"), FFN_OUT_OF.replace("{layer}", "{last}")],
        "performance",
    ),
}


def calibration_texts(n: int) -> list[str]:
    from gensim.test.utils import datapath

    text = open(datapath("lee_background.cor"), encoding="latin-1").read()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if len(s.split()) >= 4]
    return sentences[:n]


def random_token_batches(tokenizer, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` sequences of random ordinary tokens (lengths 8-128, between [CLS] and [SEP]): calibration with no
    text at all."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    sequences = [
        [tokenizer.cls_token_id, *rng.choice(ordinary, int(rng.integers(8, 129))).tolist(), tokenizer.sep_token_id]
        for _ in range(n)
    ]
    texts = [tokenizer.decode(sequence[1:-1]) for sequence in sequences]
    return batches(tokenizer, texts)


def batches(tokenizer, texts: list[str]) -> list[dict[str, np.ndarray]]:
    """Length-sorted padded batches of ``BATCH`` texts, in sorted order, each with its ``rows``."""
    ids = tokenizer(texts, truncation=True, max_length=WINDOW)["input_ids"]
    return [{**feed, "rows": rows} for rows, feed in _measure.length_sorted_batches(ids, BATCH)]


def pooled(compiled, prepared: list[dict[str, np.ndarray]], n: int) -> np.ndarray:
    request = compiled.create_infer_request()
    vectors = np.zeros((n, 0), np.float32)
    for batch in prepared:
        inputs = {name: batch[name] for name in ("input_ids", "attention_mask", "token_type_ids")}
        hidden = request.infer(inputs)[0]
        mask = batch["attention_mask"][..., None]
        mean = (hidden * mask).sum(1) / mask.sum(1)
        if vectors.shape[1] == 0:
            vectors = np.zeros((n, mean.shape[1]), np.float32)
        vectors[batch["rows"]] = mean
    return vectors


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calibration", type=int, default=300)
    ap.add_argument(
        "--calibration-source", choices=("text", "random"), default="text", help="news sentences, or random tokens"
    )
    ap.add_argument("--variants", help=f"comma-separated, of: {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "openvino-int8.json"))
    args = ap.parse_args(argv)

    import nncf
    import openvino
    from transformers import AutoModel, AutoTokenizer

    import memfit
    from memfit.engine.openvino.conversion import convert

    memfit.configure_process("cpu")
    model_dir = corpus.model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    graph = convert(model, "last_hidden_state", with_token_types=True)
    layers = model.config.num_hidden_layers

    reviews = short_texts()
    speed_texts = [reviews[i % len(reviews)] for i in range(args.n)]
    quality_sets = {"reviews": reviews, "long-tail": corpus.long_tail_corpus(300, seed=1)}
    speed_batches = batches(tokenizer, speed_texts)
    quality_batches = {name: batches(tokenizer, texts) for name, texts in quality_sets.items()}
    if args.calibration_source == "text":
        calibration_batches = batches(tokenizer, calibration_texts(args.calibration))
    else:
        calibration_batches = random_token_batches(tokenizer, args.calibration)
    calibration = [{k: v for k, v in b.items() if k != "rows"} for b in calibration_batches]

    core = openvino.Core()
    machine = _measure.machine_facts()
    bf16 = bool({"avx512_bf16", "amx_bf16"} & set(machine["cpu_flags_of_interest"]))
    compiled: dict[str, object] = {}
    chosen = args.variants.split(",") if args.variants else list(VARIANTS)
    for name in ["fp32 (no int8)", *(v for v in chosen if v != "fp32 (no int8)")]:
        spec = VARIANTS[name]
        ignored = None if spec is None else spec[0]
        if spec is None:
            variant = graph
        elif spec[1] == "weights":
            variant = nncf.compress_weights(graph.clone(), mode=nncf.CompressWeightsMode.INT8_ASYM)
        else:
            patterns = [p.replace("{last}", str(layers - 1)) for p in spec[0]]
            variant = nncf.quantize(
                graph.clone(),
                nncf.Dataset(calibration),
                preset=nncf.QuantizationPreset(spec[1]),
                model_type=nncf.ModelType.TRANSFORMER,
                subset_size=len(calibration),
                ignored_scope=nncf.IgnoredScope(patterns=patterns, validate=False) if patterns else None,
            )
        for precision in ("fp32", "bf16") if bf16 else ("fp32",):
            hint = {"fp32": "f32", "bf16": "bf16"}[precision]
            config = {"INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": os.cpu_count() or 1, "NUM_STREAMS": 1}
            label = name if ignored is None and precision == "fp32" else f"{name} / {precision}"
            if ignored is None and precision == "bf16":
                label = "bf16 (no int8)"
            compiled[label] = core.compile_model(variant, "CPU", config)

    reference = {
        name: pooled(compiled["fp32 (no int8)"], b, len(quality_sets[name])) for name, b in quality_batches.items()
    }
    rows = []
    for label, model_compiled in compiled.items():
        row: dict = {"method": label}
        for name, prepared in quality_batches.items():
            c = cosines(pooled(model_compiled, prepared, len(quality_sets[name])), reference[name])
            row[f"min_cos_{name}"] = float(c.min())
            row[f"p1_cos_{name}"] = float(np.percentile(c, 1))
        rows.append(row)
    rates: dict[str, list[float]] = {label: [] for label in compiled}
    for _ in range(args.rounds):
        for label, model_compiled in compiled.items():
            start = time.perf_counter()
            pooled(model_compiled, speed_batches, len(speed_texts))
            rates[label].append(len(speed_texts) / (time.perf_counter() - start))
    fp32_rate = statistics.median(rates["fp32 (no int8)"])
    for row in rows:
        row["texts_per_s"] = statistics.median(rates[row["method"]])
        row["runs"] = [round(r, 1) for r in rates[row["method"]]]
        row["x_fp32"] = row["texts_per_s"] / fp32_rate

    flags = ", ".join(machine["cpu_flags_of_interest"])
    versions = f"nncf {nncf.__version__}, openvino {openvino.__version__}"
    print(f"# {machine['cpu_model']} ({flags}), {machine['usable_cores']} cores; {versions}")
    _measure.print_table(
        rows,
        [
            ("method", "method", ""),
            ("texts_per_s", "texts/s", ".1f"),
            ("x_fp32", "x fp32", ".2f"),
            ("min_cos_reviews", "min cos reviews", ".5f"),
            ("p1_cos_reviews", "p1 cos reviews", ".5f"),
            ("min_cos_long-tail", "min cos long-tail", ".5f"),
            ("p1_cos_long-tail", "p1 cos long-tail", ".5f"),
        ],
    )
    payload = {"machine": machine, "nncf": nncf.__version__, "openvino": openvino.__version__, "rows": rows}
    _measure.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
