"""What a run on a cached compiled graph reads instead of importing transformers: the tokenizer and config as
transformers built them, written beside the graph.

Importing transformers and building its tokenizer costs a run ~0.9 s (2-core AMD EPYC with AVX-512 BF16:
``import transformers`` alone reads every model's source file to build its lazy import table), a tenth of
embedding 2,000 short texts with everything else cached. A run that finds the compiled graph in the cache
needs no PyTorch module, so it needs from transformers only the tokenizer and the config. The first run on a
graph (which has transformers loaded) writes both beside it: the Rust tokenizer transformers built, serialised
by the ``tokenizers`` library (so its tokens are transformers' by construction, whatever transformers adjusted
while building it), the facts memfit reads of the tokenizer, and the config's values with their defaults.
Later runs load them with ``tokenizers`` alone.

:class:`SnapshotTokenizer` answers the calls memfit makes (``tokenizer(texts, ...)`` with offsets or special
tokens, the pad id, input names, lengths, id → token); any other attribute loads the full transformers
tokenizer on first use and answers from it, so code holding an ``Encoder.tokenizer`` keeps working.
:class:`SnapshotConfig` does the same for the config. A sequence classifier's (NLI, cross-encoder, trained) is
read as transformers reads it: ``id2label`` keyed by class index (JSON keeps string keys) and ``num_labels`` its
length, so classify and rerank on a cached graph import neither transformers nor torch either (a short zero-shot
run on a tiny NLI model: 1.05-1.14 s and 171 MiB, against 4.67-4.70 s and 378 MiB when its config and tokenizer
came from transformers; Intel Xeon with AMX).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.atomic import write_bytes_atomically

log = logging.getLogger("memfit")

SNAPSHOT_FILE = "loading-snapshot.json"
SNAPSHOT_FORMAT = 1


class _FullObjectFallback:
    """Attributes the snapshot does not hold come from the full transformers object, loaded on first use."""

    def __init__(self, load_full: Callable[[], Any]):
        self._load_full = load_full
        self._full: Any = None

    def full(self) -> Any:
        if self._full is None:
            log.info("loading the full transformers object for an attribute the cached snapshot lacks")
            self._full = self._load_full()
        return self._full


class SnapshotTokenizer:
    """A fast tokenizer as transformers built it, loaded by ``tokenizers`` alone (module docstring)."""

    is_fast = True

    def __init__(self, facts: dict[str, Any], load_full: Callable[[], Any]):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(facts["backend"])
        backend.no_truncation()  # memfit windows texts itself, as it calls transformers with truncation=False
        backend.no_padding()
        self.backend_tokenizer = backend
        self.model_input_names: list[str] = list(facts["model_input_names"])
        self.pad_token_id: int | None = facts["pad_token_id"]
        self.model_max_length: int = int(facts["model_max_length"])
        self.name_or_path: str = facts["name_or_path"]
        self._special_tokens_added: dict[str, int] = facts["num_special_tokens_to_add"]
        self._fallback = _FullObjectFallback(load_full)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._fallback.full(), name)

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self._special_tokens_added["pair" if pair else "single"]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def __call__(self, text: str | list[str], text_pair: str | None = None, **options: Any) -> Any:
        """transformers' ``tokenizer(...)``. The calls memfit makes (no truncation, no padding, no tensors: lists
        of ids, optionally with offsets, special-token masks, type ids) are answered by ``tokenizers``; any
        other call by the full transformers tokenizer, so code calling ``Encoder.tokenizer`` gets its answer."""
        unknown = set(options) - _ANSWERED_OPTIONS
        if unknown or options.get("truncation") or not (isinstance(text, str) or text_pair is None):
            full = self._fallback.full()
            return full(text, **options) if text_pair is None else full(text, text_pair, **options)
        single = isinstance(text, str)
        inputs: list = [text if text_pair is None else (text, text_pair)] if single else list(text)
        encodings = self.backend_tokenizer.encode_batch(
            inputs, add_special_tokens=options.get("add_special_tokens", True)
        )
        wanted = {
            "input_ids": True,
            "token_type_ids": _asked(options, "return_token_type_ids", "token_type_ids" in self.model_input_names),
            "attention_mask": _asked(options, "return_attention_mask", "attention_mask" in self.model_input_names),
            "special_tokens_mask": bool(options.get("return_special_tokens_mask")),
            "offset_mapping": bool(options.get("return_offsets_mapping")),
        }
        result = {name: [_FIELDS[name](e) for e in encodings] for name, on in wanted.items() if on}
        return {name: values[0] for name, values in result.items()} if single else result


_ANSWERED_OPTIONS = {
    "add_special_tokens",
    "truncation",
    "return_offsets_mapping",
    "return_attention_mask",
    "return_token_type_ids",
    "return_special_tokens_mask",
}
"""The options of :meth:`SnapshotTokenizer.__call__` it answers itself (``truncation`` only when false)."""

_FIELDS = {
    "input_ids": lambda e: e.ids,
    "token_type_ids": lambda e: e.type_ids,
    "attention_mask": lambda e: e.attention_mask,
    "special_tokens_mask": lambda e: e.special_tokens_mask,
    "offset_mapping": lambda e: e.offsets,
}


def _asked(options: dict[str, Any], option: str, default: bool) -> bool:
    """transformers' rule for ``return_token_type_ids`` / ``return_attention_mask``: None means the model's."""
    value = options.get(option)
    return default if value is None else bool(value)


class SnapshotConfig:
    """A model config's values (defaults included) as attributes, without transformers (module docstring)."""

    def __init__(
        self,
        values: dict[str, Any],
        load_full: Callable[[], Any],
        aliases: dict[str, str] | None = None,
        class_names: list[str] | None = None,
    ):
        self.__dict__.update(values)
        self._aliases = aliases or {}  # standard names it holds under its own (transformers' attribute_map)
        # the names its class answers (properties, methods); None in a snapshot written before they were kept
        self._class_names = None if class_names is None else frozenset(class_names)
        if isinstance(values.get("id2label"), dict):  # a classifier's labels, as transformers' config reads them
            self.id2label = {int(index): label for index, label in values["id2label"].items()}
            self.num_labels = len(self.id2label)
        self._fallback = _FullObjectFallback(load_full)

    def __getattr__(self, name: str) -> Any:  # only for names the snapshot does not hold
        if name.startswith("_"):
            raise AttributeError(name)
        held = self._aliases.get(name)
        if held is not None and held in self.__dict__:
            return self.__dict__[held]
        if self._class_names is not None and name not in self._class_names:
            # neither a value, an alias nor the class's: the full config lacks it too (DistilBERT has no
            # intermediate_size), and a getattr with a default must not import transformers to learn that
            raise AttributeError(name)
        return getattr(self._fallback.full(), name)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def recorded_class_names(self) -> frozenset[str] | None:
        """The names the config's class answered when the snapshot was written (None: an older snapshot)."""
        return self._class_names

    def full_config(self) -> Any:
        """The full transformers config (loaded on first use)."""
        return self._fallback.full()


def save_snapshot(directory: Path, tokenizer: Any, config: Any) -> None:
    """Write the tokenizer and config a later run on this graph reads (best effort: without it, a run only
    imports transformers again)."""
    from memfit.engine.models import declared_names

    facts = {
        "format": SNAPSHOT_FORMAT,
        "tokenizer": {
            "backend": tokenizer.backend_tokenizer.to_str(),
            "model_input_names": list(tokenizer.model_input_names),
            "pad_token_id": tokenizer.pad_token_id,
            "model_max_length": int(tokenizer.model_max_length),
            "name_or_path": str(tokenizer.name_or_path),
            "num_special_tokens_to_add": {
                "single": tokenizer.num_special_tokens_to_add(pair=False),
                "pair": tokenizer.num_special_tokens_to_add(pair=True),
            },
        },
        "config": config.to_dict(),
        # the standard names some configs hold under their own (DistilBERT's hidden_size is its dim)
        "config_aliases": dict(getattr(type(config), "attribute_map", None) or {}),
        # what its class answers beyond the values: any other name the full config lacks as well
        "config_class_names": sorted(name for name in declared_names(type(config)) if not name.startswith("_")),
    }
    try:
        write_bytes_atomically(directory / SNAPSHOT_FILE, json.dumps(facts).encode())
    except (OSError, TypeError, ValueError) as exc:  # a read-only cache, or a config value JSON cannot hold
        log.info("could not cache the tokenizer and config beside the graph in %s: %s", directory, exc)


def load_snapshot(
    directory: Path, load_full_tokenizer: Callable[[], Any], load_full_config: Callable[[], Any]
) -> tuple[SnapshotTokenizer, SnapshotConfig] | None:
    """The tokenizer and config written beside the graph in ``directory``, or None (none written yet, another
    format, unreadable)."""
    facts = _read_facts(directory)
    if facts is None:
        return None
    try:
        return (
            SnapshotTokenizer(facts["tokenizer"], load_full_tokenizer),
            SnapshotConfig(
                facts["config"], load_full_config, facts.get("config_aliases"), facts.get("config_class_names")
            ),
        )
    except Exception as exc:  # noqa: BLE001 - a bad file, or a tokenizers version that reads it otherwise
        log.info("the tokenizer and config cached beside the graph were not used: %s", exc)
        return None


def load_snapshot_config(directory: Path, load_full_config: Callable[[], Any]) -> SnapshotConfig | None:
    """The config written beside the graph in ``directory`` without building the tokenizer (for a caller that only
    chooses what to load: the Rust tokenizer's build is ~35 of the ~38 ms :func:`load_snapshot` takes on MiniLM's
    30k-piece vocabulary, docs/benchmarks.md), or None as :func:`load_snapshot` gives it."""
    facts = _read_facts(directory)
    if facts is None:
        return None
    try:
        return SnapshotConfig(
            facts["config"], load_full_config, facts.get("config_aliases"), facts.get("config_class_names")
        )
    except Exception as exc:  # noqa: BLE001 - a damaged file
        log.info("the config cached beside the graph was not used: %s", exc)
        return None


def snapshot_beside(graph: Path | None, model_name: str) -> tuple[SnapshotTokenizer, SnapshotConfig] | None:
    """For a compiled backend's ``snapshot`` (``engine/backend.BackendKind``): the tokenizer and config an earlier
    run wrote beside the cached graph file ``graph``, so this run needs no transformers; None when the graph is not
    cached (or has no snapshot yet). What they do not hold, transformers loads for ``model_name``."""
    from memfit.engine.models import load_model_config, load_tokenizer

    if graph is None or not graph.is_file():
        return None
    return load_snapshot(graph.parent, lambda: load_tokenizer(model_name), lambda: load_model_config(model_name))


def snapshot_config_beside(graph: Path | None, model_name: str) -> SnapshotConfig | None:
    """:func:`snapshot_beside`'s config alone, the tokenizer left unbuilt (a compiled backend's
    ``snapshot_config``)."""
    from memfit.engine.models import load_model_config

    if graph is None or not graph.is_file():
        return None
    return load_snapshot_config(graph.parent, lambda: load_model_config(model_name))


def _read_facts(directory: Path) -> dict[str, Any] | None:
    try:
        facts = json.loads((directory / SNAPSHOT_FILE).read_text())
    except Exception as exc:  # noqa: BLE001 - none written yet, or a damaged file
        log.info("the tokenizer and config cached beside the graph were not used: %s", exc)
        return None
    return facts if isinstance(facts, dict) and facts.get("format") == SNAPSHOT_FORMAT else None
