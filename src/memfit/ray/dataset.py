"""memfit inside your own Ray Data pipeline: callable classes for ``map_batches`` and two wrappers.

``ds.map_batches(MemfitEmbedder, fn_constructor_kwargs={...}, compute=ActorPoolStrategy(size=N),
batch_size=2048, batch_format="pyarrow")`` adds an ``embedding`` column; :func:`embed_dataset` does exactly
that call. Each actor loads the model once, and on every batch Ray hands it memfit cuts its own batches
by the token budget and covers long texts with windows, so ``batch_size`` only sets how many rows one
call sees (larger: less padding, since memfit sorts a call's texts by length), not the memory used.
Only the public API is used here.
"""

from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa

from memfit.io.sinks import vectors_array
from memfit.ray.job import WORKER_CPUS

DEFAULT_BATCH_ROWS = 2048


class MemfitEmbedder:
    """A ``map_batches`` class: pooled embeddings of ``text_column`` into ``output_column``.

    ``model``, ``device``, ``dtype``, ``max_length``, ``memory_budget`` (per actor) and ``quantize`` are
    :class:`memfit.Encoder`'s; ``pooling``, ``normalize``, ``long``, ``stride``, ``prompt_name``, ``prompt`` and
    ``dimensions`` are :meth:`~memfit.Encoder.embed`'s.
    """

    def __init__(
        self,
        text_column: str = "text",
        output_column: str = "embedding",
        pooling: str | None = None,
        normalize: bool = False,
        long: str = "chunk",
        stride: int | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
        **encoder_kwargs: Any,
    ):
        from memfit.jobs.encoder import Encoder
        from memfit.ray.worker import configure_worker

        configure_worker(encoder_kwargs.get("device", "auto"))
        self.encoder = Encoder(**encoder_kwargs)
        self.text_column, self.output_column = text_column, output_column
        self.embed_kwargs = {
            "pooling": pooling,
            "normalize": normalize,
            "long": long,
            "stride": stride,
            "prompt_name": prompt_name,
            "prompt": prompt,
            "dimensions": dimensions,
        }

    def __call__(self, batch: pa.Table) -> pa.Table:
        vectors = self.encoder.embed(batch.column(self.text_column).to_pylist(), **self.embed_kwargs)
        return batch.append_column(self.output_column, vectors_array(vectors))


class MemfitClassifier:
    """A ``map_batches`` class: zero-shot (or supervised) labels of ``text_column``.

    Adds ``labels`` (best first) and ``scores`` (same order) list columns. ``labels``, ``template``,
    ``multi_label``, ``long`` and ``stride`` are :meth:`memfit.Classifier.classify`'s, the rest its constructor's.
    """

    def __init__(
        self,
        labels: Sequence[str] | None = None,
        text_column: str = "text",
        template: str | None = None,
        multi_label: bool = False,
        long: str = "truncate",
        stride: int | None = None,
        **classifier_kwargs: Any,
    ):
        from memfit.jobs.classify import Classifier
        from memfit.ray.worker import configure_worker

        configure_worker(classifier_kwargs.get("device", "auto"))
        self.classifier = Classifier(**classifier_kwargs)
        self.text_column = text_column
        self.classify_kwargs = {"labels": labels, "multi_label": multi_label, "long": long, "stride": stride}
        if template is not None:
            self.classify_kwargs["template"] = template

    def __call__(self, batch: pa.Table) -> pa.Table:
        results = self.classifier.classify(batch.column(self.text_column).to_pylist(), **self.classify_kwargs)
        batch = batch.append_column("labels", pa.array([r.labels for r in results], pa.list_(pa.string())))
        return batch.append_column("scores", pa.array([r.scores for r in results], pa.list_(pa.float32())))


def embed_dataset(
    ds, *, workers: int = 1, num_gpus: float = 0, batch_size: int = DEFAULT_BATCH_ROWS, **embedder_kwargs: Any
):
    """``ds`` with an ``embedding`` column (fixed-size list of float32), computed by ``workers`` actors.

    Lazy, like every Ray Data transform; ``embedder_kwargs`` go to :class:`MemfitEmbedder`.
    """
    return _mapped(ds, MemfitEmbedder, embedder_kwargs, workers, num_gpus, batch_size)


def classify_dataset(
    ds, *, workers: int = 1, num_gpus: float = 0, batch_size: int = DEFAULT_BATCH_ROWS, **classifier_kwargs: Any
):
    """``ds`` with ``labels`` and ``scores`` columns; ``classifier_kwargs`` go to :class:`MemfitClassifier`."""
    return _mapped(ds, MemfitClassifier, classifier_kwargs, workers, num_gpus, batch_size)


def _mapped(ds, cls: type, kwargs: dict[str, Any], workers: int, num_gpus: float, batch_size: int):
    import ray.data

    return ds.map_batches(
        cls,
        fn_constructor_kwargs=kwargs,
        compute=ray.data.ActorPoolStrategy(size=workers),
        batch_size=batch_size,
        batch_format="pyarrow",
        num_cpus=WORKER_CPUS,
        num_gpus=num_gpus,
    )
