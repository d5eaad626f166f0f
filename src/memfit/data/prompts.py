"""Prompts: the text a model was trained to see before each input (e5's ``query: `` / ``passage: ``, bge's
instructions), as sentence-transformers applies them.

A sentence-transformers model may name its prompts in ``config_sentence_transformers.json`` (``prompts``,
``default_prompt_name``); ``SentenceTransformer.encode`` then prepends the default one to every text unless
the caller names another (``prompt_name``), gives one (``prompt``), or gives the empty prompt. Its pooling
config may say ``include_prompt: false`` (INSTRUCTOR-style models): the first ``prompt_length`` positions,
the leading special tokens and the prompt's tokens, are then left out of the pooled vector. This module
resolves which prompt applies (:meth:`PromptConfig.resolve`) and measures it in tokens
(:func:`measure_prompt`); ``chunking.py`` puts it in every window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from memfit.data.tokenization import tokenize_texts
from memfit.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PromptConfig:
    """What a model's sentence-transformers files say about prompts (all optional)."""

    prompts: Mapping[str, str] = field(default_factory=dict)
    default_name: str | None = None
    include_in_pooling: bool = True  # the pooling config's ``include_prompt``

    def resolve(self, prompt_name: str | None = None, prompt: str | None = None) -> tuple[str | None, str]:
        """``(name, text)`` of the prompt a call applies, as ``SentenceTransformer.encode`` picks it: ``prompt``
        as given (``""``: none, not even the default), else the named one, else the model's default, else none
        (``""``). Giving both is refused rather than one silently ignored (sentence-transformers warns)."""
        check_prompt_options(prompt_name, prompt)
        if prompt is not None:
            return None, prompt
        name = prompt_name if prompt_name is not None else self.default_name
        if name is None:
            return None, ""
        if name not in self.prompts:
            known = ", ".join(repr(n) for n in self.prompts) or "none"
            raise ConfigError(f"unknown --prompt-name {name!r}; this model's prompts: {known}", field="prompt_name")
        return name, self.prompts[name]


def check_prompt_options(prompt_name: str | None, prompt: str | None) -> None:
    """A call names a prompt or gives one, not both (sentence-transformers would ignore the name, with a warning)."""
    if prompt is not None and prompt_name is not None:
        raise ConfigError("give --prompt or --prompt-name, not both", field="prompt_name")


@dataclass(frozen=True, slots=True)
class Prompt:
    """A resolved prompt, measured with the model's tokenizer."""

    name: str | None  # the model's name for it; None for a prompt given as text
    text: str
    tokens: int  # content tokens of ``text`` tokenized alone, as sentence-transformers counts its prompt_length
    pooled: bool  # whether its positions (and the leading special tokens) count in the pooled vector

    def as_manifest(self) -> dict:
        return {"name": self.name, "text": self.text, "include_in_pooling": self.pooled}


def measure_prompt(tokenizer, config: PromptConfig, prompt_name: str | None, prompt: str | None) -> Prompt | None:
    """The prompt a call applies, or None when none does (the empty prompt is none, as in sentence-transformers)."""
    name, text = config.resolve(prompt_name, prompt)
    if not text:
        return None
    tokens = len(tokenize_texts(tokenizer, [text], offsets=False)[0].ids)
    return Prompt(name=name, text=text, tokens=tokens, pooled=config.include_in_pooling)
