"""The ONNX Runtime backend's graph: the fp32 PyTorch module exported once to ONNX, in a child process, and cached.

- :func:`onnx_file` is where the graph is cached: ``<cache>/onnxruntime/<key>/model.onnx``, the key a hash of
  the model's files, what it computes and the versions of torch, transformers and onnx that wrote it, and of
  onnxruntime, whose optimizer fuses its attention (``graph_cache.py``).
- :func:`export_in_child` exports it in a child process (``python -m memfit.engine.onnx_export``), for the reason
  OpenVINO's conversion does (``openvino/conversion.py``): the tracer keeps the PyTorch weights alive in the
  process that traced them, and a child gives everything back when it exits.
- :func:`cached_onnx_file` finds the graph, or exports it once however many processes ask at the same time.

The export is torch's TorchScript-based ``torch.onnx.export`` (``dynamo=False``) at opset 17, with dynamic batch
and length: it needs only the ``onnx`` package, where the dynamo exporter also needs onnxscript. ONNX Runtime fuses
the graph's layer norms, GELUs and some matrix products itself when it opens it (``ORT_ENABLE_ALL``), but not the
attention of transformers 5's exports, whose mask and scaling are not the pattern its transformers optimizer matches.
So where the model's attention is transformers' interchangeable kind (BERT, RoBERTa, XLM-R...) the export traces it
in the classic pattern and the optimizer fuses each layer's into one ``Attention`` operator
(:func:`fused_attention_graph`), checked against PyTorch before it is kept: 1.76-1.83x the plain graph's tokens/s
at 512-token windows, the same at 64. Any other model (MPNet), or a fused graph that differs, gets the plain export.
"""

from __future__ import annotations

import gc
import logging
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from memfit.memory.peak import trim_host_heap

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger("memfit")

ONNX_FORMAT = 2
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
        "onnxruntime": onnxruntime_version(),  # its optimizer fuses the attention, or falls back to plain
    }
    entry = graph_entry("onnxruntime", model_name, output, versions)
    return None if entry is None else entry / "model.onnx"


ONNXRUNTIME_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml")
"""The packages that install the ``onnxruntime`` module, under their own names."""


def onnxruntime_version() -> str | None:
    """The installed ONNX Runtime's version, whichever of its packages installed it (None: not installed). The
    graph's cache key, the backend's availability, its calibrations and ``auto``'s cached choice all read it."""
    return next(filter(None, map(package_version, ONNXRUNTIME_DISTRIBUTIONS)), None)


def export(
    model: torch.nn.Module, output: GraphOutput, with_token_types: bool, path: Path, fuse_attention: bool = True
) -> None:
    """Export ``model`` (fp32, eval) to an ONNX file at ``path``, written whole or not at all: with ONNX Runtime's
    fused attention where :func:`fused_attention_graph` makes and verifies it (unless ``fuse_attention`` is False),
    else the plain export."""
    tmp = temporary_path(path, private=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not (fuse_attention and fused_attention_graph(model, output, with_token_types, tmp)):
            _trace(model, output, with_token_types, tmp, classic_attention=False)
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


def _trace(
    model: torch.nn.Module, output: GraphOutput, with_token_types: bool, path: Path, classic_attention: bool
) -> None:
    """``torch.onnx.export`` of ``model`` to ``path``, with dynamic batch and length; ``classic_attention``: the mask
    handed to the model already additive (``ClassicMaskModule``)."""
    import torch

    from memfit.engine.tracing import ClassicMaskModule, GraphModule, example_inputs

    names = graph_input_names(with_token_types)
    dynamic = {name: {0: "batch", 1: "length"} for name in names}
    dynamic[output] = {0: "batch", 1: "length"} if output == "last_hidden_state" else {0: "batch"}
    wrapped = (ClassicMaskModule if classic_attention else GraphModule)(model, output, with_token_types)
    with torch.inference_mode(), warnings.catch_warnings():
        # tracing warns about every Python-level shape check in transformers' attention code; the graph is
        # checked against PyTorch by the tests (tests/engine/test_onnxruntime.py), not by these warnings
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapped,
            example_inputs(with_token_types),
            str(path),
            input_names=list(names),
            output_names=[output],
            dynamic_axes=dynamic,
            opset_version=ONNX_OPSET,
            dynamo=False,
        )


ATTENTION_METADATA = "memfit_attention"
"""The graph's metadata key that names how its attention runs: ``fused`` where :func:`fused_attention_graph` wrote it,
absent in the plain export. The ONNX Runtime backend puts it in the memory model's key: the two hold very different
memory per batch (a tiny BERT's 8 windows of 512 tokens grew the process by 175 MiB plain and 38 MiB fused), so a
calibration fitted on one must not plan the other."""

FUSED_ATTENTION_LARGEST_BYTES = 3 * 2**29
"""Above 1.5 GiB of fp32 weights the plain export is kept: protobuf, which the optimizer reads and writes the graph
with, holds at most 2 GiB, and its copies would hold the export child at several times the weights."""

CLASSIC_ATTENTION = "memfit_onnx_classic"
"""The attention implementation a fused export traces (:func:`classic_attention`), registered with transformers'
``AttentionInterface`` under this name."""

FUSED_ATTENTION_TOLERANCE = 1e-4
"""How far the fused graph's outputs may be from PyTorch's on the real tokens of the check batch, relative to the
largest of PyTorch's (at least 1): fp32's drift grows with the values and the layers (measured 2.9e-6 on
all-MiniLM-L6-v2, whose hidden states reach ~10)."""


def classic_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention written as the BERT exports ONNX Runtime's optimizer fuses: the scores divided
    by a constant, the additive mask added, softmax, the values. transformers 5's own eager attention multiplies by
    the scale, which puts a second ``Mul`` beside the mask's where the optimizer looks for the mask's. Only traced,
    in eval mode: no dropout (``dropout`` and the model's other arguments are not used)."""
    import torch

    divisor = 1.0 / scaling if scaling is not None else float(query.shape[-1]) ** 0.5
    scores = torch.matmul(query, key.transpose(2, 3)) / divisor
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def fused_attention_graph(model: torch.nn.Module, output: GraphOutput, with_token_types: bool, path: Path) -> bool:
    """Write to ``path`` the graph with each layer's attention fused into ONNX Runtime's ``Attention`` operator, and
    say whether it did; False (nothing written) where the model's attention is not transformers' interchangeable
    kind, the optimizer does not fuse every layer, or the fused graph's outputs differ from PyTorch's.

    Why: the plain export's attention is a chain of small operators ONNX Runtime runs one by one, each reading and
    writing the batch x heads x length x length scores. Fused, all-MiniLM-L6-v2 ran 1.24x the plain graph's tokens/s
    at 256-token windows and 1.76-1.83x at 512, and the same at 64 (0.99x), 2 threads, Intel Xeon with AMX
    (docs/benchmarks.md). The trace takes the mask already additive, ``(1 - mask) * -10000`` (``ClassicMaskModule``),
    and the attention of :func:`classic_attention`: the pattern the optimizer matches. Its ``Attention`` reads the
    raw 0/1 mask, so any padding is masked as the plain graph masks it."""
    config = getattr(model, "config", None)
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if config is None or not heads or not hidden or not hasattr(model, "set_attn_implementation"):
        return False  # not a transformers model, or a transformers without attention implementations to choose
    if sum(parameter.numel() * 4 for parameter in model.parameters()) > FUSED_ATTENTION_LARGEST_BYTES:
        return False
    before = config._attn_implementation
    try:
        from transformers import AttentionInterface

        check, expected = _pytorch_check(model, output, with_token_types)  # with the model's own attention
        AttentionInterface.register(CLASSIC_ATTENTION, classic_attention)
        model.set_attn_implementation(CLASSIC_ATTENTION)
        if config._attn_implementation != CLASSIC_ATTENTION:
            return False  # an attention of its own (MPNet's relative positions): the plain export
        traced = path.with_name(path.name + ".classic")
        try:
            _trace(model, output, with_token_types, traced, classic_attention=True)
            layers = int(getattr(config, "num_hidden_layers", 0))
            if not _optimize(traced, int(heads), int(hidden), layers, path):
                return False
        finally:
            traced.unlink(missing_ok=True)
        _give_back()  # the optimizer's copies, before the check loads the graph again
        difference = _largest_difference(path, output, check, expected) / max(1.0, float(abs(expected).max()))
    except Exception as exc:  # noqa: BLE001 - the fused graph is an optimization: any failure keeps the plain export
        log.info("ONNX Runtime's fused attention was not made for this model: %s", exception_line(exc))
        path.unlink(missing_ok=True)
        return False
    finally:
        model.set_attn_implementation(before)
    if not difference <= FUSED_ATTENTION_TOLERANCE:  # NaN included
        log.info("ONNX Runtime's fused attention differs from PyTorch by %.2g: the plain export is used", difference)
        path.unlink(missing_ok=True)
        return False
    return True


def _optimize(traced: Path, heads: int, hidden: int, layers: int, path: Path) -> bool:
    """ONNX Runtime's transformers optimizer over the traced graph, written to ``path`` only when it fused the
    attention of every layer; whether it did. Its embedding fusion stays off: it assumes BERT's positions (RoBERTa's
    are offset by the padding).

    The embedding tables (the initializers ``Gather`` reads) are held aside while it runs and put back after: it
    copies the graph's initializers over and over, and multilingual-e5-small's 250k-row table is 384 of its 470 MB
    (its export child peaked at 4.04 GiB with the table in, 2.89 GiB with it held aside, 2.17 GiB for the plain
    export)."""
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    graph = onnx.load(str(traced))
    tables = {node.input[0] for node in graph.graph.node if node.op_type == "Gather"}
    held: dict[str, bytes] = {}
    for tensor in graph.graph.initializer:
        if tensor.name in tables and tensor.HasField("raw_data"):
            held[tensor.name] = tensor.raw_data
            tensor.ClearField("raw_data")
    _give_back()  # the file's bytes and the tables' copies in the graph
    options = FusionOptions("bert")
    options.enable_embed_layer_norm = False
    options.use_raw_attention_mask(True)
    optimized = optimize_model(
        graph, model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0, optimization_options=options
    )
    del graph
    if not layers or optimized.get_fused_operator_statistics().get("Attention", 0) != layers:
        return False  # nothing is written: the tables held aside go with this call
    for tensor in optimized.model.graph.initializer:
        if tensor.name in held:
            tensor.raw_data = held.pop(tensor.name)
    if held:  # a table the optimizer renamed or dropped: the plain export, not a graph without it
        return False
    onnx.helper.set_model_props(optimized.model, {ATTENTION_METADATA: "fused"})
    optimized.save_model_to_file(str(path))
    return True


def _give_back() -> None:
    """Free what the ONNX tools left for the collector (the optimizer leaves its graph in reference cycles: 1.2 of
    multilingual-e5-small's 2.1 GB after it returned) and hand it back to the kernel."""
    gc.collect()
    trim_host_heap()


def _pytorch_check(
    model: torch.nn.Module, output: GraphOutput, with_token_types: bool
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Three windows padded to different lengths, as the graph's inputs, and PyTorch's ``output`` for them."""
    import numpy as np
    import torch

    from memfit.data.chunking import Window
    from memfit.engine.batches import pad_arrays
    from memfit.engine.tracing import GraphModule

    generator = np.random.default_rng(0)
    vocab = int(getattr(model.config, "vocab_size", 1000) or 1000)
    pad = int(getattr(model.config, "pad_token_id", 0) or 0)
    windows = [
        Window(row, 0, generator.integers(min(5, vocab - 1), vocab, length, dtype=np.int64), None, 0, length)
        for row, length in enumerate((24, 15, 6))
    ]
    check = pad_arrays(windows, pad, multiple=1, token_types=with_token_types)
    with torch.inference_mode():
        tensors = [torch.from_numpy(check[name]) for name in graph_input_names(with_token_types)]
        expected = GraphModule(model, output, with_token_types)(*tensors).numpy()
    return check, expected


def _largest_difference(graph: Path, output: GraphOutput, check: dict[str, np.ndarray], expected: np.ndarray) -> float:
    """The largest absolute difference between the graph's ``output`` on ``check`` and PyTorch's, on the real
    tokens (every row of a classifier's logits)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")  # a second copy of the weights
    got = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"]).run(None, check)[0]
    real = check["attention_mask"].astype(bool) if output == "last_hidden_state" else slice(None)
    return float(abs(got - expected)[real].max())


def export_in_child(model_name: str, output: GraphOutput, with_token_types: bool, writes_in: Path | None) -> None:
    """Export and cache the graph in a child process (the module docstring says why); a one-line error. A child
    killed by a signal (out of memory: the fused attention's optimizer and check hold it at 1.3-1.4x the plain
    export's peak, docs/memory.md) is run again for the plain export. ``writes_in``: the graph's cache folder,
    where a killed child's half-written files are removed."""
    command = [sys.executable, "-m", "memfit.engine.onnx_export", model_name, output, "1" if with_token_types else "0"]
    failed = f"exporting {model_name!r} to ONNX failed"
    run_conversion_child([*command, "fused"], failed, after_a_signal=[*command, "plain"], writes_in=writes_in)


def cached_onnx_file(model_name: str, output: GraphOutput, with_token_types: bool) -> tuple[Path, bool]:
    """The cached graph's path, and whether this call exported it: exported first when missing, once however many
    processes ask at the same time (:func:`~memfit.engine.graph_cache.cached_or_converted`)."""
    path, exported = cached_or_converted(
        "onnxruntime",
        "ONNX",
        model_name,
        output,
        lambda: onnx_file(model_name, output),
        lambda folder: export_in_child(model_name, output, with_token_types, folder),
    )
    log.info("ONNX graph %s: %s", "exported and cached" if exported else "from the cache", path)
    return path, exported


def _export_main(model_name: str, output: GraphOutput, with_token_types: bool, fuse_attention: bool) -> int:
    """The child of :func:`export_in_child`: load the fp32 module, export, save. A one-line error."""
    from memfit.engine.tracing import fp32_module

    try:
        module = fp32_module(model_name, output)
        path = onnx_file(model_name, output)  # a hub model's files are local once its module is loaded
        if path is None:
            raise ModelLoadError(f"the files of {model_name!r} are not local after loading it; use --backend torch")
        export(module, output, with_token_types, path, fuse_attention)
    except MemfitError as exc:
        print(f"memfit: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(_export_main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "fused"))  # type: ignore[arg-type]
