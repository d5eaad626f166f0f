"""The ONNX Runtime backend's graph: the fp32 PyTorch module exported once to ONNX, in a child process, and cached.

- :func:`onnx_file` is where the graph is cached: ``<cache>/onnxruntime/<key>/model.onnx``, the key a hash of
  the model's files, what it computes and the versions of torch, transformers and onnx that wrote it
  (``graph_cache.py``).
- :func:`export_in_child` exports it in a child process (``python -m memfit.engine.onnx_export``), for the reason
  OpenVINO's conversion does (``openvino/conversion.py``): the tracer keeps the PyTorch weights alive in the
  process that traced them, and a child gives everything back when it exits.
- :func:`cached_onnx_file` finds the graph, or exports it once however many processes ask at the same time.

The export is torch's TorchScript-based ``torch.onnx.export`` (``dynamo=False``) at opset 17, with dynamic batch
and length: it needs only the ``onnx`` package, where the dynamo exporter also needs onnxscript. ONNX Runtime fuses
the graph's layer norms, GELUs and some matrix products itself when it opens it (``ORT_ENABLE_ALL``), so the file is
the plain export. Neither it nor its transformers optimizer fuses the attention of transformers 5's exports (their
mask is built in a pattern it does not match); the optimizer's file ran no faster (docs/benchmarks.md, "How close to
the hardware").
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.atomic import replace_durably, temporary_path
from memfit.engine.graph_cache import (
    GraphOutput,
    cached_or_converted,
    graph_entry,
    graph_input_names,
    package_version,
    run_conversion_child,
)
from memfit.errors import MemfitError, ModelLoadError, exception_line

if TYPE_CHECKING:
    import torch

log = logging.getLogger("memfit")

ONNX_FORMAT = 1
"""Bump when what :func:`export` writes changes, so older cached graphs are not used."""

ONNX_OPSET = 17  # the first with LayerNormalization as one operator


def onnx_file(model_name: str, output: GraphOutput) -> Path | None:
    """Where the ONNX graph of ``model_name`` computing ``output`` is (or will be) cached; None without local
    files."""
    versions = {
        "format": ONNX_FORMAT,
        "torch": package_version("torch"),
        "onnx": package_version("onnx"),
        "transformers": package_version("transformers"),
    }
    entry = graph_entry("onnxruntime", model_name, output, versions)
    return None if entry is None else entry / "model.onnx"


def export(model: torch.nn.Module, output: GraphOutput, with_token_types: bool, path: Path) -> None:
    """Export ``model`` (fp32, eval) to an ONNX file at ``path``, written whole or not at all."""
    import torch

    from memfit.engine.tracing import GraphModule, example_inputs

    names = graph_input_names(with_token_types)
    dynamic = {name: {0: "batch", 1: "length"} for name in names}
    dynamic[output] = {0: "batch", 1: "length"} if output == "last_hidden_state" else {0: "batch"}
    tmp = temporary_path(path, private=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            # tracing warns about every Python-level shape check in transformers' attention code; the graph is
            # checked against PyTorch by the tests (tests/engine/test_onnxruntime.py), not by these warnings
            warnings.simplefilter("ignore")
            torch.onnx.export(
                GraphModule(model, output, with_token_types),
                example_inputs(with_token_types),
                str(tmp),
                input_names=list(names),
                output_names=[output],
                dynamic_axes=dynamic,
                opset_version=ONNX_OPSET,
                dynamo=False,
            )
        replace_durably(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"the ONNX graph could not be cached in {path.parent}: {exc}; make it writable (or set "
            "MEMFIT_CACHE_DIR), or use --backend torch"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - any tracing failure means: this model does not export
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"this model does not export to ONNX ({exception_line(exc)}); use --backend torch"
        ) from exc


def export_in_child(model_name: str, output: GraphOutput, with_token_types: bool) -> None:
    """Export and cache the graph in a child process (the module docstring says why); a one-line error."""
    command = [sys.executable, "-m", "memfit.engine.onnx_export", model_name, output, "1" if with_token_types else "0"]
    run_conversion_child(command, f"exporting {model_name!r} to ONNX failed")


def cached_onnx_file(model_name: str, output: GraphOutput, with_token_types: bool) -> tuple[Path, bool]:
    """The cached graph's path, and whether this call exported it: exported first when missing, once however many
    processes ask at the same time (:func:`~memfit.engine.graph_cache.cached_or_converted`)."""
    path, exported = cached_or_converted(
        "onnxruntime",
        "ONNX",
        model_name,
        output,
        lambda: onnx_file(model_name, output),
        lambda: export_in_child(model_name, output, with_token_types),
    )
    log.info("ONNX graph %s: %s", "exported and cached" if exported else "from the cache", path)
    return path, exported


def _export_main(model_name: str, output: GraphOutput, with_token_types: bool) -> int:
    """The child of :func:`export_in_child`: load the fp32 module, export, save. A one-line error."""
    from memfit.engine.tracing import fp32_module

    try:
        module = fp32_module(model_name, output)
        path = onnx_file(model_name, output)  # a hub model's files are local once its module is loaded
        if path is None:
            raise ModelLoadError(f"the files of {model_name!r} are not local after loading it; use --backend torch")
        export(module, output, with_token_types, path)
    except MemfitError as exc:
        print(f"memfit: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(_export_main(sys.argv[1], sys.argv[2], sys.argv[3] == "1"))  # type: ignore[arg-type]
