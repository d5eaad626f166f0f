"""Dropout whose masks do not depend on how a batch is cut into micro-batches, so every budget trains the
same model.

``torch.nn.Dropout`` draws its mask from the global RNG stream, one draw per micro-batch: a budget that
cuts the batch of 16 into 3 micro-batches gives every example other masks than a budget that runs it
whole, and the trained models differ (issue 13: polarity fold 0, 0.746 at a tight budget vs 0.776 at
4 GiB). :class:`SeededDropout` replaces each ``nn.Dropout`` module: the mask of an element is a hash of
(seed, optimizer step, the example's index in the training data, the module, the element's position in
that example), so it is the same whichever micro-batch the example is in, however much padding the
micro-batch has, and when gradient checkpointing recomputes a layer.

Attention-probability dropout is not a module call: transformers' attention functions (eager and SDPA)
read the attention module's ``dropout.p`` and drop functionally from the global RNG. A probe forward finds
the dropout modules that are never called, and their ``p`` is set to 0: attention-probability dropout is
off in training. This also lets the CPU's SDPA use its fused kernel instead of the math fallback that
saves the batch x heads x length^2 probabilities and mask (measured in docs/train.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger("memfit")

_LOW32 = 0xFFFFFFFF


@dataclass
class DropoutKeys:
    """What the masks of the next forward are a function of; the trainer sets ``step`` and ``examples``."""

    seed: int
    step: int = 0  # optimizer steps done before this one
    examples: Sequence[int] | None = None  # training-data index of each row of the micro-batch

    def example_keys(self, module_index: int, rows: int) -> torch.Tensor:
        """``(rows, 2)`` 32-bit keys, one pair per example: a hash of (seed, step, example, module)."""
        examples = self.examples if self.examples is not None and len(self.examples) == rows else range(rows)
        keys = [
            np.random.SeedSequence([self.seed, self.step, int(e), module_index]).generate_state(2) for e in examples
        ]
        return torch.from_numpy(np.asarray(keys, dtype=np.int64))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xorshift-multiply rounds) on int64 tensors holding values below 2**32.

    Multipliers below 2**31 keep every product under 2**63, so no int64 arithmetic overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _LOW32
    return x ^ (x >> 16)


class SeededDropout(torch.nn.Dropout):
    """``nn.Dropout`` with masks from :class:`DropoutKeys` instead of the global RNG (see the module doc).

    The element counter runs over each example's own elements in row-major order, so for a
    ``(batch, length, hidden)`` input the mask of position ``t`` does not depend on the padded length."""

    def __init__(self, p: float, module_index: int, keys: DropoutKeys):
        super().__init__(p)
        self.module_index = module_index
        self.keys = keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keys = self.example_keys(x.shape[0]).to(x.device)
        counter = torch.arange(x[0].numel(), device=x.device, dtype=torch.int64).view(x.shape[1:])
        threshold = int(self.p * 2**32)
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        # one example at a time: the hash works on int64, 8 bytes an element beside the activation's 2 or 4, and
        # its temporaries for a whole micro-batch were the largest allocations of a checkpointed step (bert-base,
        # 6 x 512 tokens: a step's later micro-batches peaked ~600 MiB above the same step without them, over a
        # 3 GiB budget the plan had kept)
        for row in range(x.shape[0]):
            torch.ge(_hash32(_hash32(counter ^ keys[row, 0]) ^ keys[row, 1]), threshold, out=keep[row])
        return torch.where(keep, x, 0.0).mul_(1.0 / (1.0 - self.p))  # in place: autograd keeps only ``keep``

    def example_keys(self, rows: int) -> torch.Tensor:
        return self.keys.example_keys(self.module_index, rows)


def install_seeded_dropout(model: torch.nn.Module, seed: int, probe_inputs: dict[str, torch.Tensor]) -> DropoutKeys:
    """Replace the model's ``nn.Dropout`` modules by :class:`SeededDropout`; turn off the ones used
    functionally (attention probabilities), found by a forward on ``probe_inputs``. Returns the keys the
    trainer updates before each micro-batch."""
    keys = DropoutKeys(seed)
    replaced: list[tuple[str, SeededDropout]] = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Dropout and child.p > 0:
                seeded = SeededDropout(child.p, len(replaced), keys)
                setattr(parent, name, seeded)
                replaced.append((f"{parent_name}.{name}".lstrip("."), seeded))
    called: set[int] = set()
    hooks = [module.register_forward_pre_hook(lambda m, args: called.add(id(m))) for _, module in replaced]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(**probe_inputs)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    functional = [(name, module) for name, module in replaced if id(module) not in called]
    for _, module in functional:
        module.p = 0.0
    if functional:
        log.info(
            "dropout read functionally (attention probabilities) turned off in training: %s",
            ", ".join(name for name, _ in functional[:3]) + (" …" if len(functional) > 3 else ""),
        )
    return keys
