"""Conversion: the fp32 PyTorch module traced once into an OpenVINO graph, and its int8 copy, in a child process.

- :func:`convert` traces the loaded fp32 PyTorch module once (``openvino.convert_model``) with dynamic batch
  and length and returns only what the heads read (``last_hidden_state`` or ``logits``); ``cache.save_graph``
  writes it (in fp32: the precision is chosen when it is compiled, so one file serves both).
- :func:`convert_in_child` does that in a child process, once per model and machine (why: its docstring),
  running this module (``python -m memfit.engine.openvino.conversion``); the child starts with this module and
  ``cache.py`` only, not the compiled graph or the backend.

``--quantize int8`` (with NNCF installed, the ``int8`` extra) compiles an int8 copy of the graph instead,
quantized once by NNCF's post-training quantization in the converting child and cached beside the fp32 graph
(:func:`quantize_graph`): int8 weights and activations everywhere but the feed-forward output projections, whose
inputs (the GELU's long-tailed outputs) int8 would wreck, and the rest in the float precision asked. Its
activation ranges are calibrated on random sequences of ordinary tokens, no text: measured on all-MiniLM-L6-v2,
that calibration gave the same min cosine against fp32 as 300 real news sentences (0.996-0.997;
benchmarks/bench_openvino_int8.py, docs/precision.md), and the quality guard measures every int8 run on the
run's own texts.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from memfit.engine.graph_cache import GraphOutput, graph_input_names, not_cached_error, run_conversion_child
from memfit.engine.openvino.cache import cached_graph, graph_file, import_openvino, int8_graph_file, save_graph
from memfit.errors import ModelLoadError, exception_line

if TYPE_CHECKING:
    import torch

INT8_KEPT_IN_FLOAT = (r".*layer\.\d+\.output\.dense.*", r".*layer\.\d+\.ffn\.lin2.*")
"""Operations :func:`quantize_graph` leaves in float: the feed-forward output projections (BERT, RoBERTa, MPNet,
MiniLM: ``layer.N.output.dense``; DistilBERT: ``layer.N.ffn.lin2``). In int8 they cost all-MiniLM-L6-v2 its
min cosine (0.985 with them, 0.996 without, on long texts); an architecture named otherwise is quantized whole and
judged by the quality guard."""

INT8_CALIBRATION_SEQUENCES = 300
INT8_CALIBRATION_LENGTHS = (8, 128)  # ordinary tokens per sequence, special tokens added
INT8_CALIBRATION_BATCH = 30
"""Calibration sequences per inference, length-sorted so that a batch pads little: NNCF's two statistics passes
over the 300 sequences one at a time took most of MiniLM's int8 load (25.8 s with its fp32 graph cached, 19.2 s in
batches of 30, the same sequences; min cosine against sentence-transformers fp32 0.9945 / 0.9940 one at a time, 0.9963 /
0.9947 batched, on 200 movie reviews / 300 long-tail texts: docs/precision.md)."""


def convert(model: torch.nn.Module, output: GraphOutput, with_token_types: bool):
    """Trace ``model`` (fp32, eval) into an OpenVINO graph with dynamic batch and length."""
    import torch

    from memfit.engine.tracing import GraphModule, exact_position_buckets, example_inputs

    openvino = import_openvino()

    names = graph_input_names(with_token_types)
    try:
        with torch.inference_mode(), warnings.catch_warnings(), exact_position_buckets():
            # tracing warns about every Python-level shape check in transformers' attention code; the graph
            # is checked against PyTorch by the tests (tests/engine/test_backends.py), not by these warnings
            warnings.simplefilter("ignore")
            graph = openvino.convert_model(
                GraphModule(model, output, with_token_types),
                example_input=example_inputs(with_token_types),
                input=[(name, [-1, -1], torch.long) for name in names],
            )
    except Exception as exc:  # noqa: BLE001 - any tracing failure means: this model does not convert
        raise ModelLoadError(
            f"OpenVINO cannot convert this model ({exception_line(exc)}); use --backend torch"
        ) from exc
    for node, name in zip(graph.inputs, names):
        node.get_tensor().set_names({name})
    return graph


def quantize_graph(graph, tokenizer, with_token_types: bool, position_limit: int):
    """An int8 copy of ``graph`` by NNCF's post-training quantization (module docstring), its activation ranges
    calibrated on random sequences of ordinary tokens of ``tokenizer``'s vocabulary, none longer than the model's
    ``position_limit``, in length-sorted padded batches (:data:`INT8_CALIBRATION_BATCH`). Raises
    :class:`ModelLoadError` when NNCF cannot quantize it."""
    import nncf

    from memfit.data.chunking import SpecialTokens, Window
    from memfit.engine.batches import pad_arrays

    generator = np.random.default_rng(0)
    specials = SpecialTokens.from_tokenizer(tokenizer)
    special = set(tokenizer.all_special_ids)
    ordinary = np.array([i for i in range(len(tokenizer)) if i not in special])
    longest = min(INT8_CALIBRATION_LENGTHS[1], position_limit - len(specials.prefix) - len(specials.suffix))
    shortest = min(INT8_CALIBRATION_LENGTHS[0], longest)
    lengths = (int(generator.integers(shortest, longest + 1)) for _ in range(INT8_CALIBRATION_SEQUENCES))
    sequences = sorted(
        ([*specials.prefix, *generator.choice(ordinary, length).tolist(), *specials.suffix] for length in lengths),
        key=len,
    )
    windows = [Window(row, 0, np.asarray(ids, np.int64), None, 0, len(ids)) for row, ids in enumerate(sequences)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    samples = [
        pad_arrays(windows[start : start + INT8_CALIBRATION_BATCH], pad, multiple=1, token_types=with_token_types)
        for start in range(0, len(windows), INT8_CALIBRATION_BATCH)
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return nncf.quantize(
                graph,
                nncf.Dataset(samples),
                model_type=nncf.ModelType.TRANSFORMER,
                subset_size=len(samples),
                ignored_scope=nncf.IgnoredScope(patterns=list(INT8_KEPT_IN_FLOAT), validate=False),
            )
    except Exception as exc:  # noqa: BLE001 - any failure of NNCF's means: this graph does not quantize
        raise ModelLoadError(
            f"NNCF cannot quantize this model to int8 ({exception_line(exc)}); "
            "drop --quantize int8, or use --backend torch"
        ) from exc


def convert_in_child(
    model_name: str, output: GraphOutput, with_token_types: bool, int8: bool, writes_in: Path | None
) -> None:
    """Convert and cache the graph in a child process, once per model and machine (and with ``int8`` its int8
    copy, :func:`quantize_graph`). ``writes_in``: the graph's cache folder, where a killed child's half-written files
    are removed (``graph_cache.run_conversion_child``).

    In this process the traced graph shares the PyTorch weights and the tracer keeps them (and ~55 MiB more)
    alive after both are deleted (measured on MiniLM: 145 MiB of the job's memory held for good); a child gives
    everything back when it exits. Its own peak (~0.56 GiB for MiniLM, docs/memory.md) comes before the job
    starts and once: later runs read the cache."""
    command = [
        sys.executable,
        "-m",
        "memfit.engine.openvino.conversion",
        model_name,
        output,
        "1" if with_token_types else "0",
        "1" if int8 else "0",
    ]
    run_conversion_child(command, f"converting {model_name!r} for OpenVINO failed", writes_in=writes_in)


def _convert_main(model_name: str, output: GraphOutput, with_token_types: bool, int8: bool) -> int:
    """The child of :func:`convert_in_child`: load the fp32 PyTorch module, convert, save; or, with ``int8``,
    quantize the cached fp32 graph and save that. A one-line error."""
    from memfit.errors import MemfitError

    try:
        if int8:
            from memfit.engine.models import load_model_config, load_tokenizer, model_position_limit

            path = cached_graph(graph_file(model_name, output), model_name)
            graph = import_openvino().Core().read_model(str(path))
            limit = model_position_limit(load_model_config(model_name))
            quantized = quantize_graph(graph, load_tokenizer(model_name), with_token_types, limit)
            if not save_graph(quantized, int8_graph_file(path)):
                raise ModelLoadError(f"the int8 OpenVINO graph of {model_name!r} could not be cached in {path.parent}")
        else:
            from memfit.engine.tracing import fp32_module

            graph = convert(fp32_module(model_name, output), output, with_token_types)
            path = graph_file(model_name, output)  # a hub model's files are local once its module is loaded
            if path is None or not save_graph(graph, path):
                raise not_cached_error("OpenVINO", model_name)
    except MemfitError as exc:
        print(f"memfit: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(_convert_main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"))  # type: ignore[arg-type]
