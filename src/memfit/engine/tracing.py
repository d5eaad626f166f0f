"""The PyTorch module as the compiled backends trace it: positional inputs and the one output the heads read.

OpenVINO's conversion (``openvino/conversion.py``) and the ONNX export (``onnx_export.py``) both run in a child
process that loads the fp32 module (:func:`fp32_module`), wraps it (:class:`GraphModule`) and traces it once.
OpenVINO's conversion traces relative position buckets as a lookup (:func:`exact_position_buckets`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from memfit.engine.graph_cache import GraphOutput, graph_input_names
from memfit.memory.device import Device


class GraphModule(torch.nn.Module):
    """The model with positional inputs and one output, as the graph has them."""

    def __init__(self, model: torch.nn.Module, output: GraphOutput, with_token_types: bool):
        super().__init__()
        self.model = model
        self.output = output
        self.with_token_types = with_token_types
        # in the model's mode, not a new module's (training): torch.onnx.export traces in eval mode and then puts the
        # wrapper, and with it the model, back in the mode it found, which left an eval model training (dropout on)
        self.train(model.training)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.with_token_types:
            inputs["token_type_ids"] = token_type_ids
        return getattr(self.model(**inputs), self.output)


class ClassicMaskModule(GraphModule):
    """:class:`GraphModule` handing the model its mask already additive, ``(1 - mask) * -10000`` over batch x 1 x 1
    x length, as BERT built it before transformers 5: the pattern ONNX Runtime's optimizer recognises as an
    attention mask (``onnx_export.fused_attention_graph``). transformers passes a 4-D mask through unchanged."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        additive = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * -10000.0
        return super().forward(input_ids, additive, token_type_ids)


def example_inputs(with_token_types: bool) -> tuple[torch.Tensor, ...]:
    """A batch of 2 windows of 16 tokens to trace with (batch and length are dynamic in the graph)."""
    fill = {"token_type_ids": torch.zeros}
    return tuple(fill.get(name, torch.ones)(2, 16, dtype=torch.long) for name in graph_input_names(with_token_types))


def fp32_module(model_name: str, output: GraphOutput) -> torch.nn.Module:
    """The fp32 module on the CPU that computes ``output``: the base model, or the sequence classifier."""
    from transformers import AutoModel

    from memfit.engine.models import load_model
    from memfit.engine.pooled_classifier import load_sequence_classifier

    cpu = Device("cpu")
    if output == "last_hidden_state":
        return load_model(model_name, AutoModel, cpu, "fp32")
    return load_sequence_classifier(model_name, cpu, "fp32")


def _bucket_lookup(
    compute: Callable[..., torch.Tensor], table_limit: Callable[..., int], saturates: bool
) -> Callable[..., torch.Tensor]:
    """``compute`` (relative positions -> buckets, through a float logarithm) as a lookup in a table of its results
    for every relative position within ``table_limit(...)`` either way, computed in fp32 as the graph is traced and
    kept in it as a constant. Beyond the limit, where the buckets ``saturate`` there, the limit's bucket; else
    ``compute`` itself (DeBERTa's keep growing: only a window longer than its table reaches past it)."""

    def lookup(relative_position: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        limit = table_limit(*args, **kwargs)
        # a constant of the trace (a tensor made from a list): traced as operations on an arange instead, the table
        # OpenVINO's converter computed came out mirrored
        table = torch.tensor(compute(torch.arange(-limit, limit + 1), *args, **kwargs).tolist())
        looked_up = table[relative_position.clamp(-limit, limit) + limit]
        if saturates:
            return looked_up
        return torch.where(relative_position.abs() <= limit, looked_up, compute(relative_position, *args, **kwargs))

    return lookup


@contextlib.contextmanager
def exact_position_buckets() -> Iterator[None]:
    """MPNet's and DeBERTa-v2's relative position buckets traced as a lookup in a table, not as the float logarithm
    transformers computes them with, for as long as the context lasts.

    OpenVINO's CPU plugin runs a bf16 graph's float operations before its matrix products in bf16, and the bucket
    arithmetic is among them: MPNet's ``8 + log(n / 8) / log(16) * 8`` is truncated to an integer, and rounded to
    bf16's 8 significant bits, a value just below a whole number became it. Traced as transformers writes it, the bf16
    graph put distances 16, 32 and 90 in the next bucket (``tests/engine/test_architectures.py``), in every layer:
    all-mpnet-base-v2 in bf16 kept a min cosine of 0.99723 against fp32 on 200 movie-review sentences (every token of
    a 29-token sentence 6-59% off), where PyTorch's bf16 kept 0.99988; looked up, 0.99997 (docs/precision.md).
    DeBERTa-v2's log buckets (DeBERTa-v3's configs use them) went wrong at 112 distances beyond 128 tokens."""
    from transformers.models.deberta_v2 import modeling_deberta_v2
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    mpnet = MPNetEncoder.__dict__["relative_position_bucket"]
    deberta = modeling_deberta_v2.make_log_bucket_position

    def mpnet_limit(num_buckets: int = 32, max_distance: int = 128) -> int:
        return max_distance  # from there on, the last bucket: log(n / max_exact) / log(max_distance / max_exact) >= 1

    def deberta_limit(bucket_size: int, max_position: int) -> int:
        return max_position

    MPNetEncoder.relative_position_bucket = staticmethod(_bucket_lookup(mpnet.__func__, mpnet_limit, saturates=True))
    modeling_deberta_v2.make_log_bucket_position = _bucket_lookup(deberta, deberta_limit, saturates=False)
    try:
        yield
    finally:
        MPNetEncoder.relative_position_bucket = mpnet
        modeling_deberta_v2.make_log_bucket_position = deberta
