"""memfit: run BERT-family encoders over corpora of any size and any text length within a memory budget.

Public API (implementation lives in the stage modules; see docs/architecture.md):

- :class:`Encoder` — pooled and token-level embeddings, streamed to Parquet with :meth:`Encoder.embed_to`.
- :func:`read` — load an output directory written by memfit.
- :func:`plan` — the memory plan of a model against a budget (what ``memfit plan`` prints).
- :func:`train` — fine-tune a (relation) classifier within a memory budget.
- :class:`MemfitError` and its subclasses — every error memfit raises on purpose.
"""

from importlib.metadata import PackageNotFoundError, version

from memfit.classify import Classifier
from memfit.encoder import Encoder, TokenEmbedding
from memfit.errors import (
    ConfigError,
    DoesNotFitError,
    InputError,
    MemfitError,
    ModelLoadError,
    OutputError,
    QualityError,
)
from memfit.memory import PlanReport, plan
from memfit.outputs import EmbeddingOutput, read
from memfit.training import train

try:
    __version__ = version("memfit")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"

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
    "TokenEmbedding",
    "__version__",
    "plan",
    "read",
    "train",
]
