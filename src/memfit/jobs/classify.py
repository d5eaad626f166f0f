"""The classify job: zero-shot classification into labels named at run time, on the budgeted engine.

Two modes share the streaming loop of ``runner.py`` (blocks → windows → planned batches → OOM guard):

- **nli** — a cross-encoder trained on natural-language inference (MNLI-style BERT, StructBERT,
  bart-large-mnli). Every (text, label) pair becomes one model input, premise = text and hypothesis =
  ``template.format(label)``, and the entailment logit says how well the label fits. Scores are those of
  transformers' ``ZeroShotClassificationPipeline``: single-label = softmax of the entailment logits
  across labels; multi-label (or a single label) = per label, softmax over (contradiction, entailment).
  Unlike the pipeline, each text is tokenized once, pairs are built per block (texts x labels never
  exist for the whole corpus) and batched by length under the memory budget, so padding is small.
- **embedding** — a bi-encoder (the bundled MiniLM by default): each label is embedded once through the
  template, each text once, and the score is the cosine similarity turned into a probability
  (softmax over labels with a temperature; multi-label: an independent sigmoid per label around a
  similarity threshold). One forward pass per text instead of one per (text, label).

- **supervised** — a sequence classifier with its own labels, such as the output of ``memfit train``:
  each text runs once and the score of each of the model's labels is its softmax probability
  (``labels`` may select a subset; the probabilities are still those over all the model's classes).

Long texts: ``long="truncate"`` keeps the head of the text (as the pipeline and sentence-transformers
do). ``long="chunk"`` covers the whole text with overlapping windows; NLI scores each (window, label)
pair and keeps, per label, the window with the *highest entailment* (see :func:`nli_scores`);
embedding mode mean-pools the windows as ``memfit embed`` does; supervised mode averages the windows'
class probabilities.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

import numpy as np

from memfit.data.chunking import LongMode
from memfit.jobs.classify_jobs import ClassifyJob, EmbeddingJob, NliJob, SupervisedJob
from memfit.jobs.classify_scores import (  # noqa: F401 - re-exported: the classify API as it has always been imported
    Classification,
    check_labels,
    embedding_scores,
    entailment_ids,
    logits_head,
    nli_scores,
    quoted,
    ranked,
    read_classifications,
)
from memfit.defaults import CLASSIFY_MODES as MODES
from memfit.defaults import (  # noqa: F401 - re-exported
    DEFAULT_SIMILARITY_THRESHOLD,
    DEFAULT_TEMPERATURE,
    DEFAULT_TEMPLATE,
)
from memfit.jobs.embed_job import EmbedJob
from memfit.jobs.encoder import Encoder
from memfit.engine.batches import AdaptiveBudget, Engine
from memfit.errors import ConfigError
from memfit.memory.host_budget import HostBudget
from memfit.engine.models import is_pooled_classifier, resolve_model_name
from memfit.engine.precision import CALIBRATION_TEXTS
from memfit.jobs.runner import StreamInput, records_from_texts, run_job, stream_to, text_list
from memfit.jobs.hosted import RuntimeHost
from memfit.engine.runtime import Runtime, load_runtime, model_config

log = logging.getLogger("memfit")

Mode = Literal["auto", "nli", "embedding", "supervised"]


def resolve_mode(mode: str, config) -> Literal["nli", "embedding", "supervised"]:
    """``auto`` → ``nli`` when the model's config has an entailment class, ``supervised`` for another
    sequence classifier (e.g. the output of ``memfit train``), else ``embedding``."""
    if mode not in MODES:
        raise ConfigError(f"unknown classify mode {mode!r}; choose one of {', '.join(MODES)}")
    has_entailment = entailment_ids(config)[0] is not None
    is_classifier = any(
        a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or []
    ) or is_pooled_classifier(config)
    if mode == "auto":
        return "nli" if has_entailment else "supervised" if is_classifier else "embedding"
    if mode == "nli" and not has_entailment:
        labels = dict(getattr(config, "label2id", None) or {})
        raise ConfigError(
            f"this model has no entailment class in its config (label2id: {labels}); NLI zero-shot needs an "
            "MNLI-style model, or use --mode embedding"
        )
    if mode == "supervised" and not is_classifier:
        raise ConfigError("supervised mode needs a sequence-classification model (e.g. the output of memfit train)")
    return mode  # type: ignore[return-value]


@dataclass(frozen=True)
class LabelInputs:
    """An embedding-mode classify call before its labels are embedded (:meth:`Classifier.label_inputs`)."""

    labels: list[str]
    multi_label: bool
    text_job: EmbedJob  # embeds the texts to classify
    label_job: EmbedJob  # embeds label_texts
    label_texts: list[str]  # each label through the template


class Classifier(RuntimeHost):
    """Zero-shot classification of texts of any number and length within a memory budget.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2 (embedding mode), a local directory or a hub id.
    ``mode``: ``auto`` (NLI when the model's config has an entailment class, supervised for another
    sequence classifier, else embedding), ``nli``, ``embedding``, ``supervised``. ``device``, ``dtype``,
    ``max_length``, ``memory_budget``, ``backend`` and ``offload`` are as for
    :class:`~memfit.Encoder`; in NLI mode the default ``max_length`` is the tokenizer's
    ``model_max_length`` (capped by the position embeddings), the length the pipeline truncates to.
    ``temperature`` and ``threshold`` shape embedding-mode scores (see the module docstring).
    In embedding mode with reduced precision, the quality guard (``precision.py``) measures the first
    texts to classify, once. ``streams``: batches a host runs at once (``memfit serve``'s model workers).
    ``runtime``: an already loaded :class:`~memfit.engine.runtime.Runtime` (the loading
    arguments are then unused; its task must match the mode).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        mode: Mode = "auto",
        device: str = "auto",
        dtype: str = "auto",
        max_length: int | None = None,
        memory_budget: str | int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        threshold: float = DEFAULT_SIMILARITY_THRESHOLD,
        *,
        backend: str = "auto",
        offload: str = "auto",
        streams: int = 1,
        runtime: Runtime | None = None,
    ):
        for name, value, floor in (("temperature", temperature, 0.0), ("threshold", threshold, None)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
            if floor is not None and not value > floor:
                raise ConfigError(f"{name} must be > {floor:g}, got {value}")
        if runtime is None:
            name = resolve_model_name(model)
            self.mode = resolve_mode(mode, model_config(name, backend))
            runtime = load_runtime(
                name,
                device=device,
                dtype=dtype,
                memory_budget=memory_budget,
                max_length=max_length,
                backend=backend,
                offload=offload,
                streams=streams,
                task="embedding" if self.mode == "embedding" else "classification",
            )
        else:
            self.mode = resolve_mode(mode, runtime.config)
            if (self.mode == "embedding") != (runtime.task == "embedding"):
                raise ConfigError(f"{self.mode} mode cannot run on a runtime loaded for {runtime.task}")
        self.runtime = runtime
        self.temperature = float(temperature)
        self.threshold = float(threshold)
        self.encoder: Encoder | None = None
        if self.mode == "embedding":
            self.encoder = Encoder(runtime=runtime)
            return
        self.model_labels = [str(runtime.config.id2label[i]) for i in range(runtime.config.num_labels)]
        # per Classifier (never shared between runs): host limits and the OOM-adaptive budget
        self.host: HostBudget = runtime.host
        self.budget = runtime.adaptive_budget()
        log.info("classify mode %s", self.mode)

    # what the runtime fixed at load time beyond RuntimeHost's
    model = property(lambda self: self.runtime.model)
    uses_token_types = property(lambda self: self.runtime.uses_token_types)
    memory = property(lambda self: self.runtime.memory)
    entailment_id = property(lambda self: entailment_ids(self.runtime.config)[0])
    contradiction_id = property(lambda self: entailment_ids(self.runtime.config)[1])

    # -- public API -------------------------------------------------------------------------------

    def classify(
        self,
        texts: Iterable[str],
        labels: Sequence[str] | None = None,
        template: str = DEFAULT_TEMPLATE,
        multi_label: bool = False,
        long: LongMode = "truncate",
        stride: int | None = None,
        progress: bool | None = False,
    ) -> list[Classification]:
        """Per text: every label, best first, and its score, in input order.

        Single-label scores sum to 1 over the labels; with ``multi_label`` each label is scored on its
        own in [0, 1] (NLI with one label does the same, as the pipeline does). ``labels`` is required
        in the zero-shot modes; in supervised mode it defaults to all of the model's labels.
        """
        texts = text_list(texts)
        self._check_quality(texts[:CALIBRATION_TEXTS])
        job = self._job(labels, template, multi_label, long, stride)
        out: list[Classification] = []
        for _, block in run_job(
            job,
            records_from_texts(texts),
            self._engine(job),
            self._budget,
            self.device,
            self._limits(job),
            progress,
            len(texts),
        ):
            out.extend(ranked(job.labels, row) for row in block.scores)
        return out

    def classify_to(
        self,
        source: str | os.PathLike | Iterable[str],
        out_dir: str | os.PathLike,
        labels: Sequence[str] | None = None,
        template: str = DEFAULT_TEMPLATE,
        multi_label: bool = False,
        long: LongMode = "truncate",
        stride: int | None = None,
        text_field: str = "text",
        id_field: str | None = None,
        input_format: str | None = None,
        resume: bool = False,
        progress: bool | None = None,
        part_size: int | None = None,
    ) -> dict[str, Any]:
        """Stream classifications of ``source`` to ``out_dir`` (Parquet parts + manifest.json).

        Columns: ``id``, ``labels`` (list of strings, best first) and ``scores`` (list of float32, same
        order). ``source`` and ``resume`` work as in :meth:`Encoder.embed_to`. ``part_size``: texts per
        part (default 2048, fewer with many NLI labels); an interrupted run keeps every finished part.
        Returns the manifest.
        """
        job = self._job(labels, template, multi_label, long, stride)
        settings = {
            "job": "classify",
            "model": self.model_name,
            "mode": self.mode,
            "labels": job.labels,
            "template": template,
            "multi_label": multi_label,
            "dtype": self.dtype,
            "backend": self.runtime.backend.name,
            "max_length": self.max_length,
            "long": long,
            "stride": job.stride,
            "temperature": self.temperature if self.mode == "embedding" else None,
            "threshold": self.threshold if self.mode == "embedding" and multi_label else None,
        }
        if isinstance(job, SupervisedJob) and job.activation == "sigmoid":
            # recorded only for these models, whose parts earlier versions scored with a softmax: a resume of a run
            # they began is refused instead of mixing the two (other models' manifests stay as they were)
            settings["scores"] = "sigmoid"
        encoder = self.encoder
        guard_pending = encoder is not None and encoder.min_cosine is not None and encoder.quality is None
        return stream_to(
            lambda writer, background: job,
            StreamInput(source, text_field, id_field, input_format),
            out_dir,
            settings,
            engine=self._engine(job),
            budget=self._budget,
            device=self.device,
            limits=self._limits(job, part_size),
            writes_in_flight=self._host.writes_in_flight,
            resume=resume,
            progress=progress,
            part_size=part_size,
            check_sample=self._check_quality if guard_pending else None,
            sample_size=CALIBRATION_TEXTS,
            info=lambda: (
                {"backend_choice": self.runtime.backend_choice}
                if encoder is None
                else {
                    "backend_choice": self.runtime.backend_choice,
                    "quality": None if encoder.quality is None else encoder.quality.as_manifest(),
                }
            ),
        )

    def job(
        self,
        labels: Sequence[str] | None = None,
        template: str = DEFAULT_TEMPLATE,
        multi_label: bool = False,
        long: LongMode = "truncate",
        stride: int | None = None,
    ) -> NliJob | SupervisedJob:
        """The prepare/finish job of one classify call, for front ends that batch windows themselves
        (``memfit serve``). NLI and supervised modes; in embedding mode the job needs the labels' vectors,
        which the front end computes itself: :meth:`label_inputs`, then :meth:`embedding_job`."""
        if self.mode == "embedding":
            raise ConfigError("an embedding-mode job needs label vectors: use label_inputs() and embedding_job()")
        return self._job(labels, template, multi_label, long, stride)  # type: ignore[return-value]

    def label_inputs(
        self,
        labels: Sequence[str] | None,
        template: str = DEFAULT_TEMPLATE,
        multi_label: bool = False,
        long: LongMode = "truncate",
        stride: int | None = None,
    ) -> LabelInputs:
        """Embedding mode, step 1 (every option checked, nothing run): the texts' embed job, and the label
        texts with the job that embeds them. Step 2, :meth:`embedding_job`, takes their vectors."""
        if self.mode != "embedding":
            raise ConfigError(f"label vectors are for embedding mode; this classifier is in {self.mode} mode")
        labels = self._named_labels(labels, template)
        if len(labels) == 1 and not multi_label:
            raise ConfigError(
                f"one label ({quoted(labels[0])}) in embedding mode would score every text 1.0 (a softmax "
                "over one label); name two or more labels, or pass --multi-label to score the label "
                "on its own against --threshold"
            )
        encoder = self.encoder
        # each label through the template once, truncated, without the guard: it measures the texts to classify
        return LabelInputs(
            labels=labels,
            multi_label=multi_label,
            text_job=encoder.job(normalize=True, long=long, stride=stride),
            label_job=encoder.job(normalize=True, long="truncate"),
            label_texts=[template.format(label) for label in labels],
        )

    def embedding_job(self, inputs: LabelInputs, label_vectors: np.ndarray) -> EmbeddingJob:
        """Embedding mode, step 2: the job that scores texts against ``label_vectors`` (``inputs.label_job``'s
        vectors of ``inputs.label_texts``, ``(k, d)``)."""
        return EmbeddingJob(
            inputs.text_job, inputs.labels, label_vectors, inputs.multi_label, self.temperature, self.threshold
        )

    # -- internals --------------------------------------------------------------------------------

    def _job(
        self, labels: Sequence[str] | None, template: str, multi_label: bool, long: LongMode, stride: int | None
    ) -> ClassifyJob:
        if self.mode == "supervised":
            # its scores are the trained head's class probabilities: a template or multi_label would change
            # nothing, and the manifest would say they did
            if multi_label or template != DEFAULT_TEMPLATE:
                raise ConfigError(
                    "multi_label and template apply to the zero-shot modes (nli, embedding); a supervised "
                    "classifier's scores are its trained class probabilities"
                )
            return SupervisedJob(self.runtime, self._supervised_labels(labels), self.model_labels, long, stride)
        if self.mode == "nli":
            return NliJob(self.runtime, self._named_labels(labels, template), template, multi_label, long, stride)
        inputs = self.label_inputs(labels, template, multi_label, long, stride)
        label_vectors = self.encoder.pooled(inputs.label_job, inputs.label_texts, progress=False)
        return self.embedding_job(inputs, label_vectors)

    def _named_labels(self, labels: Sequence[str] | None, template: str) -> list[str]:
        """The zero-shot modes' labels: required, checked (:func:`check_labels`)."""
        if labels is None:
            raise ConfigError(f"{self.mode} mode classifies into labels you name: pass labels (--labels a,b,c)")
        return check_labels(labels, template)

    def _check_quality(self, texts: Sequence[str]) -> None:
        """Embedding mode: the precision guard on the texts to classify (``memfit classify`` has no
        ``--min-cosine``, so a refusal offers only ``--dtype fp32``)."""
        if self.encoder is not None:
            self.encoder.check_quality(texts, self.encoder.default_pooling, can_accept=False)

    def _supervised_labels(self, labels: Sequence[str] | None) -> list[str]:
        """The model's own labels, or the requested subset of them."""
        if labels is None:
            return list(self.model_labels)
        unknown = [label for label in labels if label not in self.model_labels]
        if unknown or not labels:
            raise ConfigError(
                f"supervised mode scores the model's own labels {self.model_labels}; unknown: "
                f"{', '.join(quoted(label) for label in unknown) if unknown else 'none given'}"
            )
        return list(dict.fromkeys(labels))

    @property
    def _host(self) -> HostBudget:
        return self.encoder.host if self.encoder is not None else self.host

    @property
    def _budget(self) -> AdaptiveBudget:
        return self.encoder.budget if self.encoder is not None else self.budget

    def _engine(self, job: ClassifyJob) -> Engine:
        return self.runtime.engine(job.head)

    def _limits(self, job: ClassifyJob, part_size: int | None = None):
        # blocks (= output parts) hold about the same number of model inputs whatever the number of labels
        return self._host.block_limits(part_size, pairs_per_text=len(job.labels) if isinstance(job, NliJob) else 1)
