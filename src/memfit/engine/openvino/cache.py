"""The graph cache of the compiled backend: where a model's OpenVINO graph is kept on disk, and how it is written.

- :func:`graph_file` finds the cached graph: ``<cache>/openvino/<key>/model.xml`` (+ ``.bin``), the key a hash of
  the model's files, the task, the transformers and OpenVINO versions (``engine/graph_cache.py``, which the ONNX
  Runtime backend shares).
- :func:`save_graph` writes a graph atomically (the ``.bin`` first, the ``.xml`` last: an ``.xml`` present means
  a whole graph). The graph is stored in fp32; the precision is chosen when it is compiled (``compiled.py``), so
  one file serves both.
- The int8 copy of a graph (``--quantize int8``, made in ``conversion.py``) is cached beside the fp32 graph
  (:func:`int8_graph_file`), named by its scheme and the NNCF that made it.

The installed OpenVINO's version is part of the key, so this module also holds how OpenVINO is imported
(:func:`import_openvino`, its usage telemetry declined); every module of the backend imports it from here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from memfit.atomic import replace_durably, temporary_path
from memfit.engine.graph_cache import GraphOutput, graph_entry, not_cached_error, package_version

log = logging.getLogger("memfit")

GRAPH_FORMAT = 2
"""Bump when what :func:`convert` (``conversion.py``) writes changes, so older cached graphs are not used. 2: relative
position buckets looked up (``tracing.exact_position_buckets``)."""

INT8_SCHEME = 2
"""Bump when what :func:`quantize_graph` (``conversion.py``) makes changes (what it keeps in float, its calibration), so
older cached int8 graphs are not used."""


def import_openvino() -> Any:
    """The ``openvino`` module, imported with its usage telemetry declined.

    Importing ``openvino`` imports its conversion tools, which send a usage event to Google Analytics from a
    worker thread unless the user has opted out with OpenVINO's own tool (a consent file in ``~/intel``); the
    process then waits for that thread when it exits (up to the sender's 3 s time-out on a slow network).
    memfit sends nothing about its users anywhere, so the consent check answers "declined" while the module
    loads. Raises ImportError when OpenVINO is not installed."""
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # no telemetry package: nothing to decline
        import openvino

        return openvino
    check = OptInChecker.check
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
    try:
        import openvino
    finally:
        OptInChecker.check = check
    return openvino


def openvino_version() -> str | None:
    """The installed OpenVINO's version, or None when it is not installed (importing it costs ~0.2 s)."""
    try:
        openvino = import_openvino()
    except ImportError:
        return None
    return str(openvino.get_version())


def graph_file(model_name: str, output: GraphOutput) -> Path | None:
    """Where the graph of ``model_name`` computing ``output`` is (or will be) cached; None without local files."""
    versions = {
        "format": GRAPH_FORMAT,
        "openvino": openvino_version(),
        "transformers": package_version("transformers"),  # without importing it (graph_snapshot.py)
    }
    entry = graph_entry("openvino", model_name, output, versions)
    return None if entry is None else entry / "model.xml"


def nncf_version() -> str | None:
    """The installed NNCF's version (what ``--quantize int8`` on the compiled backend needs), or None."""
    return package_version("nncf")


def int8_graph_file(fp32_graph: Path) -> Path:
    """Where the int8 copy of the graph cached at ``fp32_graph`` is: beside it, named by its scheme and the NNCF
    that made it."""
    return fp32_graph.with_name(f"model-int8-{INT8_SCHEME}-nncf{nncf_version()}.xml")


# -- the graph files ---------------------------------------------------------------------------------------------------


def save_graph(graph, path: Path) -> bool:
    """Write ``graph`` to ``path`` (.xml + .bin) so that a reader never sees half of it; False if not writable."""
    openvino = import_openvino()

    tmp = temporary_path(path, private=True)  # its .bin beside it: tmp.with_suffix(".bin")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        openvino.save_model(graph, str(tmp), compress_to_fp16=False)
        replace_durably(tmp.with_suffix(".bin"), path.with_suffix(".bin"))
        replace_durably(tmp, path)
        return True
    except (OSError, RuntimeError) as exc:
        log.info("could not cache the OpenVINO graph in %s: %s", path.parent, exc)
        for leftover in (tmp, tmp.with_suffix(".bin")):
            leftover.unlink(missing_ok=True)
        return False


def cached_graph(path: Path | None, model_name: str) -> Path:
    """``path`` when the child wrote it, else the error that says the cache cannot be written."""
    if path is None or not path.is_file():
        raise not_cached_error("OpenVINO", model_name)
    return path
