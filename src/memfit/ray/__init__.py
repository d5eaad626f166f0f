"""memfit on Ray Data: the same jobs on many workers, the same output, every row exactly once.

- :func:`embed_to` / :func:`classify_to` — what ``memfit embed/classify --executor ray`` runs: a whole job
  over a file (or a Parquet directory) into a local-style output directory, resumable (``job.py``).
- :func:`embed_dataset` / :func:`classify_dataset` and the ``map_batches`` classes
  :class:`MemfitEmbedder` / :class:`MemfitClassifier` — memfit inside your own pipeline (``dataset.py``).

Ray is imported only when one of these runs; ``import memfit`` never imports it. See docs/scale-out.md.
"""

from __future__ import annotations

from typing import Any

from memfit.ray.dataset import MemfitClassifier, MemfitEmbedder, classify_dataset, embed_dataset

_MODEL_KEYS = {
    "embed": (
        "model",
        "device",
        "dtype",
        "backend",
        "offload",
        "max_length",
        "memory_budget",
        "quantize",
        "min_cosine",
        "quality_check",
    ),
    "classify": (
        "model",
        "mode",
        "device",
        "dtype",
        "backend",
        "offload",
        "max_length",
        "memory_budget",
        "temperature",
        "threshold",
    ),
}
_JOB_KEYS = ("workers", "address", "text_field", "id_field", "input_format", "resume", "part_size", "worker_class")


def embed_to(source: str, out_dir: str, **options: Any) -> dict[str, Any]:
    """:meth:`memfit.Encoder.embed_to` on Ray: ``options`` are the Encoder's, ``embed_to``'s and
    ``workers`` / ``address`` / ``part_size``; ``memory_budget`` applies per worker. Returns the manifest."""
    return _run("embed", source, out_dir, options)


def classify_to(source: str, out_dir: str, **options: Any) -> dict[str, Any]:
    """:meth:`memfit.Classifier.classify_to` on Ray (options as for :func:`embed_to`)."""
    return _run("classify", source, out_dir, options)


def _run(job: str, source: str, out_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    from memfit.ray.job import run_ray_job

    model_kwargs = {k: options.pop(k) for k in _MODEL_KEYS[job] if k in options}
    job_kwargs = {k: options.pop(k) for k in _JOB_KEYS if k in options}
    return run_ray_job(job, source, out_dir, model_kwargs, options, **job_kwargs)


__all__ = ["MemfitClassifier", "MemfitEmbedder", "classify_dataset", "classify_to", "embed_dataset", "embed_to"]
