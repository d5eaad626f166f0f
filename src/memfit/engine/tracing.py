"""The PyTorch module as the compiled backends trace it: positional inputs and the one output the heads read.

OpenVINO's conversion (``openvino/conversion.py``) and the ONNX export (``onnx_export.py``) both run in a child
process that loads the fp32 module (:func:`fp32_module`), wraps it (:class:`GraphModule`) and traces it once.
"""

from __future__ import annotations

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
