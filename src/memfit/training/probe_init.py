"""A new head starts as the linear probe: logistic regression on the frozen encoder's pooled vectors.

Fine-tuning a randomly initialised head moves the pretrained encoder by the gradients of a head that
does not yet know the task; with the few hundred steps of a small data set the result was worse than
logistic regression on the frozen embeddings (issue 13: 0.560 vs 0.635 on polarity). Starting the
head at that regression's solution ("linear probing, then fine-tuning", Kumar et al., ICLR 2022) makes
the run start where the probe ends and fine-tuning improve from there (measured in docs/train.md).

The features are the classifier layer's inputs, captured with a forward hook while the engine runs
the training examples in eval mode under the training budget and its OOM guard (``n x hidden`` floats
on the host: 30 MiB for 10,000 examples of a 768-wide model). The regression is full-batch L-BFGS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memfit.data.chunking import Window
from memfit.engine.batches import TorchEngine, run_windows
from memfit.data.relation import Examples
from memfit.memory.device import Device

PROBE_L2 = 1e-2
"""L2 penalty on the probe's weights (added to the mean cross-entropy): keeps the probe's loss above 0 on
separable training sets, so fine-tuning still has a gradient to follow."""


def linear_head(model) -> torch.nn.Linear | None:
    """The model's final classification layer when it is one linear layer (BERT-style and memfit's pooled
    heads), else None (the head then starts from its random initialisation)."""
    head = getattr(model, "classifier", None)
    return head if isinstance(head, torch.nn.Linear) else None


def initialise_head_as_probe(model, data: Examples, engine_budget, device: Device, pad_token_id: int, autocast) -> bool:
    """Set the model's linear head to the logistic regression on its frozen inputs; False if there is none."""
    head = linear_head(model)
    if head is None:
        return False
    features = classifier_inputs(model, head, data.windows, engine_budget, device, pad_token_id, autocast)
    weight, bias = fit_logistic_regression(
        torch.from_numpy(features), torch.from_numpy(data.labels), head.out_features, PROBE_L2
    )
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return True


def classifier_inputs(
    model, head: torch.nn.Linear, windows: Sequence[Window], budget, device: Device, pad_token_id: int, autocast
) -> np.ndarray:
    """``(n, hidden)`` float32: what ``head`` receives for each window, in eval mode."""
    captured: list[torch.Tensor] = []

    def keep_input(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        captured.append(args[0].detach().float())

    def take_features(output: Any, attention_mask: torch.Tensor, batch: Sequence[Window]) -> list[np.ndarray]:
        rows = captured[-1].cpu().numpy()
        captured.clear()  # a forward that ran out of memory may have left nothing, or a stale row set
        return list(rows)

    was_training = model.training
    model.eval()
    hook = head.register_forward_hook(keep_input)
    try:
        with autocast():
            rows = run_windows(TorchEngine(model, device, pad_token_id, take_features), windows, budget, device)
    finally:
        hook.remove()
        model.train(was_training)
    return np.stack(rows).astype(np.float32)


def fit_logistic_regression(
    x: torch.Tensor, y: torch.Tensor, classes: int, l2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression, mean cross-entropy + ``l2 * |W|^2``, by full-batch L-BFGS;
    returns ``(weight (classes, d), bias (classes,))``."""
    x = x.double()
    weight = torch.zeros(classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach().float(), bias.detach().float()
