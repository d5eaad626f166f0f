"""memfit: run BERT-family encoders over corpora of any size and any text length within a memory budget.

Public API (implementation lives in the stage modules; see docs/architecture.md):

- :class:`Encoder` — pooled and token-level embeddings, streamed to Parquet with :meth:`Encoder.embed_to`.
- :class:`Classifier` — zero-shot and trained classification; :class:`Reranker` — (query, document)
  relevance by a cross-encoder (``rank``, ``score``, ``rerank_to``).
- :func:`read` — load an output directory written by memfit.
- :func:`plan` — the memory plan of a model against a budget (what ``memfit plan`` prints).
- :func:`load_runtime` / :class:`Runtime` — a model loaded once with its memory plan, for hosts that
  feed it work themselves (a server, a Ray worker); ``Encoder(runtime=...)`` and
  ``Classifier(runtime=...)`` run jobs on it.
- :func:`configure_process` — the process-wide settings the budget promise relies on (docs/memory.md).
- :func:`train` — fine-tune a (relation) classifier within a memory budget; it returns a :class:`TrainResult`.
- :class:`MemfitError` and its subclasses — every error memfit raises on purpose.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from memfit.defaults import VERSION
from memfit.errors import (
    ConfigError,
    DoesNotFitError,
    InputError,
    MemfitError,
    ModelLoadError,
    OutputError,
    QualityError,
)

__version__ = VERSION

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and readers
    from memfit.jobs.classify import Classifier
    from memfit.jobs.encoder import Encoder, TokenEmbedding
    from memfit.io.outputs import EmbeddingOutput, read
    from memfit.jobs.plan_report import PlanReport, plan
    from memfit.jobs.rerank import RankedDocument, Reranker
    from memfit.engine.process import configure_process
    from memfit.engine.runtime import Runtime, load_runtime
    from memfit.training import TrainResult, train

# The model-running API is imported on first use (PEP 562): it pulls in torch and transformers, which
# take seconds to load, and the command line must be able to refuse a bad option before that.
_LAZY = {
    "Classifier": "memfit.jobs.classify",
    "Encoder": "memfit.jobs.encoder",
    "TokenEmbedding": "memfit.jobs.encoder",
    "PlanReport": "memfit.jobs.plan_report",
    "RankedDocument": "memfit.jobs.rerank",
    "Reranker": "memfit.jobs.rerank",
    "plan": "memfit.jobs.plan_report",
    "Runtime": "memfit.engine.runtime",
    "load_runtime": "memfit.engine.runtime",
    "configure_process": "memfit.engine.process",
    "EmbeddingOutput": "memfit.io.outputs",
    "read": "memfit.io.outputs",
    "TrainResult": "memfit.training",
    "train": "memfit.training",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "Classifier",
    "ConfigError",
    "DoesNotFitError",
    "EmbeddingOutput",
    "Encoder",
    "InputError",
    "MemfitError",
    "ModelLoadError",
    "OutputError",
    "PlanReport",
    "QualityError",
    "RankedDocument",
    "Reranker",
    "Runtime",
    "TokenEmbedding",
    "TrainResult",
    "__version__",
    "configure_process",
    "load_runtime",
    "plan",
    "read",
    "train",
]
