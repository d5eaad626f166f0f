"""``memfit embed/classify --executor ray``: a whole job on Ray Data, with a local run's output layout.

The driver reads the input into a Dataset of ``row, id, text, line`` rows (``inputs.py``), Ray Data runs
``map_batches(PartWorker)`` on an actor pool of ``workers`` (one GPU each with ``device="cuda"``),
each worker writes one part per batch of ``part_size`` rows (``worker.py``), and the driver lists the
parts in the manifest as they arrive (``commit.py``). Ray decides the parallelism and restarts a worker
that dies (its task runs again and rewrites the same files); memfit decides the batches inside each
worker, under ``memory_budget`` per worker. Errors a worker raises reach the caller as the memfit
error they are, so the CLI prints the same one line as for a local run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Iterator

from memfit.defaults import DEFAULT_BLOCK_TEXTS
from memfit.errors import ConfigError, MemfitError
from memfit.io.fingerprint import input_fingerprint
from memfit.io.preflight import check_input, check_options
from memfit.io.vector_codec import CALIBRATED
from memfit.jobs.runner import StreamInput
from memfit.ray.commit import RayOutput
from memfit.data.shards import STDIN, is_url
from memfit.ray.inputs import Remaining, input_dataset

OBJECT_STORE_BYTES = 256 * 2**20  # of a local cluster: batches of texts are small, and Ray spills to disk
WORKER_CPUS = 0.9
"""CPUs a worker asks for. Not 1: actors holding every CPU would leave Ray Data's read tasks waiting forever."""


def run_ray_job(
    job: str,
    source: str,
    out_dir: str,
    model_kwargs: dict[str, Any],
    call_kwargs: dict[str, Any],
    *,
    workers: int = 1,
    address: str | None = None,
    text_field: str = "text",
    id_field: str | None = None,
    input_format: str | None = None,
    resume: bool = False,
    part_size: int | None = None,
    worker_class: type | None = None,
) -> dict[str, Any]:
    """Run ``job`` ("embed" or "classify") over ``source`` into ``out_dir`` on Ray; return the manifest.

    ``model_kwargs`` build each worker's :class:`memfit.Encoder` / :class:`memfit.Classifier`;
    ``call_kwargs`` go to its ``embed_to`` / ``classify_to`` (pooling, labels, …). ``address``: join
    that cluster (``"auto"``, ``"ray://host:10001"``, …); ``None`` starts a local one with ``workers``
    CPUs and stops it at the end (a cluster this process already joined is used as it is).
    ``worker_class``: a :class:`~memfit.ray.worker.PartWorker` subclass (tests inject faults with it).
    """
    from memfit.ray.worker import PartWorker

    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if job == "embed" and call_kwargs.get("output_dtype") in CALIBRATED:
        raise ConfigError(
            f"--output-dtype {call_kwargs['output_dtype']} calibrates on the first part, which Ray workers do not "
            "share; run it with --executor local, or take binary / ubinary",
            field="output_dtype",
        )
    check_options(part_size=part_size)
    part_texts = part_size or DEFAULT_BLOCK_TEXTS  # as a local run's parts
    if source != STDIN:
        check_input(source, input_format, text_field, id_field)
    model_kwargs = _per_worker_budget(model_kwargs, workers, address)
    input_settings = StreamInput(source, text_field, id_field, input_format).settings()  # as a local run's
    output = RayOutput(out_dir, input_settings, input_fingerprint(source), resume)
    if output.complete:
        return output.manifest
    device = str(model_kwargs.get("device", "auto"))
    with _cluster(address, workers):
        import ray.data

        remaining = Remaining(output.done_ranges())
        dataset, total = input_dataset(source, text_field, id_field, input_format, part_texts, remaining)
        parts = dataset.map_batches(
            worker_class or PartWorker,
            fn_constructor_kwargs={
                "job": job,
                "out_dir": out_dir if is_url(out_dir) else os.path.abspath(out_dir),
                "model_kwargs": model_kwargs,
                "call_kwargs": call_kwargs,
                "expected_settings": output.expected_settings,
            },
            # one part at a time per worker: a part takes seconds or more, and parts queued behind a busy
            # worker would leave the others idle at the end of the job
            compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=1),
            batch_size=part_texts,
            batch_format="pyarrow",
            num_cpus=WORKER_CPUS,
            num_gpus=1 if device.startswith("cuda") else 0,
        )
        with _memfit_errors():
            for batch in parts.iter_batches(batch_size=None, batch_format="pyarrow"):
                for entry in batch.column("entry").to_pylist():
                    output.add(json.loads(entry))
    output.finish(total)
    return output.manifest


@contextlib.contextmanager
def _cluster(address: str | None, workers: int) -> Iterator[None]:
    """Join ``address``, or start a local cluster of ``workers`` CPUs; leave a cluster already joined alone."""
    import ray
    import ray.data

    # memfit's own lines only, as for a local run: Ray's notices stay in its session logs
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)  # it logs every task error with its stack
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.raise_original_map_exception = True  # a worker's InputError reaches the driver as itself
    if ray.is_initialized():
        yield
        return
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address is not None:
        ray.init(address=address, **quiet)
    else:
        # "local": a new cluster even where another one runs (`ray start`, another job's test cluster): without
        # an address Ray would join the one it finds in /tmp/ray, and refuse num_cpus for it
        ray.init(
            address="local",
            num_cpus=workers,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            **quiet,
        )
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _memfit_errors() -> Iterator[None]:
    """Re-raise the memfit error a worker or read task raised, without Ray's wrapping and traceback."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - anything that is not a memfit error is raised unchanged
        found = _find_memfit_error(exc)
        if found is None:
            raise
        raise found from None


def _find_memfit_error(exc: BaseException) -> MemfitError | None:
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        # Ray re-raises a task's error as a subclass of both RayTaskError and the error's class; the
        # original sits in ``.cause``
        if isinstance(error, MemfitError) and type(error).__module__ == "memfit.errors":
            # Ray Data appends its retry notes to the message; memfit's messages are one line
            error.args = (str(error).split("\n", 1)[0],)
            return error
        stack.extend([getattr(error, "cause", None), error.__cause__, error.__context__])
    return None


def _per_worker_budget(model_kwargs: dict[str, Any], workers: int, address: str | None) -> dict[str, Any]:
    """Without ``memory_budget``, local CPU workers share 90% of the available memory (each would
    otherwise take 90% for itself); on a cluster or a GPU each worker plans for its own device."""
    if model_kwargs.get("memory_budget") is not None or address is not None:
        return model_kwargs
    if str(model_kwargs.get("device", "auto")).startswith("cuda"):
        return model_kwargs
    import psutil

    return {**model_kwargs, "memory_budget": int(0.9 * psutil.virtual_memory().available / workers)}
