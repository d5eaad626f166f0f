"""Fine-tuning a sequence classifier under a memory budget: ``memfit train`` and :func:`train`.

Read in this order: :mod:`~memfit.training.api` (the run from data to saved model; its options are a
:class:`~memfit.training.config.TrainConfig`, its result a :class:`~memfit.training.result.TrainResult`),
:mod:`~memfit.training.model` (which classification head), :mod:`~memfit.training.plan` (the memory
model and its calibration), :mod:`~memfit.training.trainer` (accumulated micro-batches, the OOM guard),
:mod:`~memfit.training.checkpoint` (checkpoints and resume). docs/train.md tells the same for users.
"""

from memfit.training.api import macro_f1, train
from memfit.training.plan import TrainPlan, plan_training
from memfit.training.result import TrainResult

__all__ = ["TrainPlan", "TrainResult", "macro_f1", "plan_training", "train"]
