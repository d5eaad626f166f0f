"""Stage 2: tokenize texts once and cut them into model windows.

Every text is tokenized exactly once, without special tokens and without truncation, by the fast
tokenizer in batches of bounded size (``tokenization.py``). The token ids are then cut into *windows*
of at most ``max_length`` tokens (special tokens included), so a text of any length becomes one or more
model inputs:

- ``long="truncate"``: one window holding the first tokens (what sentence-transformers does).
- ``long="chunk"``: overlapping windows that cover every token. Consecutive windows overlap by
  ``stride`` tokens; the last window is aligned to the end of the text so every window is full.

Each window records which of its positions it *owns*: every token of the text is owned by exactly one
window, the one whose centre is nearest to the token (ties go to the earlier window), i.e. the window
in which the token sits most centrally and so sees the most context on both sides. The leading special
tokens (``[CLS]``) are owned by the first window and the trailing ones (``[SEP]``) by the last, so a text
that fits one window yields exactly the tokenizer's ``tokenizer(text)`` sequence, and a long text
yields one row per token of ``tokenizer(text)`` without truncation.

With a prompt (``prompts.py``) each text is tokenized as ``prompt + text``, as sentence-transformers does, and
the prompt's tokens (the first ``Prompt.tokens`` of that sequence) are put in *every* window, right after the
leading special tokens, so each window of a long text is read the way the model was trained to read its
inputs. The prompt's positions are never token rows; for pooling, the first window owns them (when the
model's pooling includes the prompt), so a text that fits one window pools exactly what
sentence-transformers pools, and a long text counts the prompt once, like every other token. With
``include_prompt: false`` no window pools its leading special tokens or prompt (sentence-transformers leaves
out the first ``prompt_length`` positions). Character offsets stay those of the user's text.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import numpy as np

from memfit.defaults import LONG_MODES
from memfit.errors import ConfigError
from memfit.data.prompts import Prompt
from memfit.data.tokenization import TokenizedText, tokenize_texts  # noqa: F401 - the stage's entry point

LongMode = Literal["truncate", "chunk"]


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Where a model's tokenizer puts its special tokens, learned from the tokenizer itself.

    Fast tokenizers add special tokens in their post-processor; rather than hard-coding BERT's
    ``[CLS] a [SEP] b [SEP]`` we tokenize placeholder texts and read the layout back, so RoBERTa's
    ``<s> a </s></s> b </s>`` and any other template work the same way.
    """

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    pair_prefix: tuple[int, ...]
    pair_middle: tuple[int, ...]
    pair_suffix: tuple[int, ...]
    first_type_id: int
    second_type_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "SpecialTokens":
        single = tokenizer("a", add_special_tokens=True, return_special_tokens_mask=True)
        prefix, first_content, suffix = _split_specials(single["input_ids"], single["special_tokens_mask"])
        pair = tokenizer("a", "b", add_special_tokens=True, return_special_tokens_mask=True, return_token_type_ids=True)
        ids, mask = pair["input_ids"], pair["special_tokens_mask"]
        # "a" may take several tokens (e.g. a prefix-space piece and the letter), and a template may
        # put nothing between the texts: measure "a" alone instead of assuming one token each
        content = [i for i, special in enumerate(mask) if not special]
        first_start = content[0]
        first_end = first_start + len(first_content)
        second_start = next(i for i in content if i >= first_end)
        second_end = content[-1] + 1
        types = pair.get("token_type_ids") or [0] * len(ids)
        return cls(
            prefix=tuple(prefix),
            suffix=tuple(suffix),
            pair_prefix=tuple(ids[:first_start]),
            pair_middle=tuple(ids[first_end:second_start]),
            pair_suffix=tuple(ids[second_end:]),
            first_type_id=int(types[first_start]),
            second_type_id=int(types[second_start]),
        )

    @property
    def single_overhead(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @property
    def pair_overhead(self) -> int:
        return len(self.pair_prefix) + len(self.pair_middle) + len(self.pair_suffix)


def _split_specials(ids: Sequence[int], special_mask: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Split ``ids`` into leading special tokens, content, trailing special tokens."""
    start = 0
    while start < len(ids) and special_mask[start]:
        start += 1
    end = len(ids)
    while end > start and special_mask[end - 1]:
        end -= 1
    return list(ids[:start]), list(ids[start:end]), list(ids[end:])


@dataclass(frozen=True, slots=True)
class Window:
    """One model input: a slice of a text's tokens wrapped in the model's special tokens.

    ``own_start:own_end`` are the positions of ``input_ids`` this window contributes to the text's
    merged token sequence (see the module docstring for the rule); of those, the prompt's positions
    ``prompt_start:prompt_end`` are pooled (from ``pool_start`` on) but are no token rows.
    """

    item: int  # index of the text within its block
    index: int  # window number within the text
    input_ids: np.ndarray  # (L,) int64, special tokens included
    token_type_ids: np.ndarray | None  # (L,) int64, only for text pairs
    own_start: int
    own_end: int
    prompt_start: int = 0  # the prompt's tokens, in every window of a prompted text; empty without one
    prompt_end: int = 0
    pool_start: int = 0  # the first position pooled (the CLS row of ``cls`` pooling): past the prompt when excluded

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def token_count(self) -> int:
        """The token rows this window gives its text: its owned positions less the prompt's."""
        prompt_owned = max(0, min(self.own_end, self.prompt_end) - max(self.own_start, self.prompt_start))
        return self.own_end - self.own_start - prompt_owned


def window_starts(n_tokens: int, content_size: int, stride: int) -> list[int]:
    """Start offsets (in content tokens) of the windows covering ``n_tokens`` tokens.

    Windows advance by ``content_size - stride``; the last one is aligned to the end of the text.
    """
    if n_tokens <= content_size:
        return [0]
    step = content_size - stride
    starts = list(range(0, n_tokens - content_size, step))
    starts.append(n_tokens - content_size)
    return starts


def default_stride(max_length: int) -> int:
    """Default overlap between windows: a quarter of the window.

    Enough context on both sides of every owned token (each token is at least ~1/8 of a window away
    from the edge of the window that owns it, except at the text's ends) at a compute overhead of about
    1/3 over non-overlapping windows.
    """
    return max(0, max_length // 4)


def check_window_options(max_length: int, special: SpecialTokens, stride: int, prompt_tokens: int = 0) -> int:
    """Validate window options; return the number of content tokens per window."""
    content = max_length - special.single_overhead - prompt_tokens
    if content < 1:
        if prompt_tokens:
            raise ConfigError(
                f"the prompt takes {prompt_tokens} tokens and leaves no room for text in a window of {max_length}"
            )
        raise ConfigError(f"max_length {max_length} leaves no room for text next to the special tokens")
    check_stride_type(stride)
    if not 0 <= stride < content:
        raise ConfigError(f"stride must be between 0 and {content - 1} for max_length {max_length}, got {stride}")
    return content


def check_long_mode(long: str) -> None:
    """``long`` is one of :data:`LONG_MODES`."""
    if long not in LONG_MODES:
        raise ConfigError(f"unknown long-text mode {long!r}; choose truncate or chunk")


def resolve_stride(
    long: str, stride: int | None, max_length: int, special: SpecialTokens, prompt: Prompt | None = None
) -> int:
    """The one check of the long-text options of a job that windows single texts: a known ``long`` mode,
    and a stride (default: :func:`default_stride`) that leaves each window content of its own, next to the
    prompt's tokens when there is a prompt."""
    check_long_mode(long)
    stride = default_stride(max_length) if stride is None else stride
    check_window_options(max_length, special, stride, prompt_token_count(prompt))
    return stride


def prompt_token_count(prompt: Prompt | None) -> int:
    """The tokens a prompt takes in every window (0 without one)."""
    return 0 if prompt is None else prompt.tokens


def make_windows(
    item: int,
    tokens: TokenizedText,
    special: SpecialTokens,
    max_length: int,
    long: LongMode,
    stride: int,
    prompt_ids: np.ndarray | None = None,
    prompt_pooled: bool = True,
) -> list[Window]:
    """Cut one tokenized text into windows that own every token exactly once (chunk) or its head; with
    ``prompt_ids``, each window carries them after its leading special tokens (module docstring)."""
    n_prompt = 0 if prompt_ids is None else len(prompt_ids)
    content_size = max_length - special.single_overhead - n_prompt
    n = len(tokens.ids)
    if long == "truncate":
        starts = [0]
    else:
        starts = window_starts(n, content_size, stride)
    prefix = np.asarray(special.prefix, dtype=np.int64)
    if prompt_ids is not None:
        prefix = np.concatenate([prefix, prompt_ids])
    suffix = np.asarray(special.suffix, dtype=np.int64)
    n_prefix = len(prefix)  # leading special tokens and the prompt
    prompt_start = n_prefix - n_prompt
    windows = []
    last = len(starts) - 1
    for w, start in enumerate(starts):
        end = min(start + content_size, n)
        # Ownership boundaries between consecutive windows: midpoint between their centres.
        own_lo = 0 if w == 0 else _boundary(starts[w - 1], start, content_size)
        own_hi = end if w == last else _boundary(start, starts[w + 1], content_size)
        ids = np.concatenate([prefix, tokens.ids[start:end], suffix])
        windows.append(
            Window(
                item=item,
                index=w,
                input_ids=ids,
                token_type_ids=None,
                # positions in `ids`; the first window also owns the prefix, the last the suffix
                own_start=0 if w == 0 else n_prefix + own_lo - start,
                own_end=len(ids) if w == last else n_prefix + own_hi - start,
                prompt_start=prompt_start if n_prompt else 0,
                prompt_end=n_prefix if n_prompt else 0,
                pool_start=0 if prompt_pooled or not n_prompt else n_prefix,
            )
        )
    return windows


def window_texts(
    tokenizer,
    texts: Sequence[str],
    special: SpecialTokens,
    max_length: int,
    long: LongMode,
    stride: int,
    prompt: Prompt | None = None,
    call_chars: int | None = None,
    offsets: bool = True,
) -> tuple[list[TokenizedText], list[Window]]:
    """A block of single texts tokenized and cut into windows, in text order: the prepare step of every
    job that runs texts on their own (embed, supervised classify). The tokens returned are the texts' own
    (with a prompt: what follows it, offsets in the text), as the token rows give them. Under ``truncate`` a
    long text is tokenized only as far as its one window and one token more (``tokenize_texts``' ``max_tokens``):
    the window is the same, and the token more tells :func:`truncated_count` that it lost tokens.
    ``call_chars``: characters per tokenizer call; ``offsets=False``: ids only (``tokenize_texts``)."""
    head = max_length - special.single_overhead + 1 if long == "truncate" else None
    if prompt is None:
        tokenized = tokenize_texts(tokenizer, texts, max_tokens=head, call_chars=call_chars, offsets=offsets)
        windows = [
            window
            for item, tokens in enumerate(tokenized)
            for window in make_windows(item, tokens, special, max_length, long, stride)
        ]
        return tokenized, windows
    tokenized, windows = [], []
    # the prompt's tokens come first in the joint sequence, so a head of a window and one more still holds them
    joint_texts = [prompt.text + text for text in texts]
    joints = tokenize_texts(tokenizer, joint_texts, max_tokens=head, call_chars=call_chars, offsets=offsets)
    for item, joint in enumerate(joints):
        tokens, prompt_ids = split_prompt(joint, prompt)
        tokenized.append(tokens)
        windows.extend(make_windows(item, tokens, special, max_length, long, stride, prompt_ids, prompt.pooled))
    return tokenized, windows


def split_prompt(joint: TokenizedText, prompt: Prompt) -> tuple[TokenizedText, np.ndarray]:
    """``prompt + text`` tokenized whole, split as sentence-transformers masks it: its first ``prompt.tokens``
    tokens are the prompt's, the rest the text's (offsets moved back to the text; a token that straddles
    the two starts at 0)."""
    offsets = None if joint.offsets is None else np.maximum(joint.offsets[prompt.tokens :] - len(prompt.text), 0)
    return TokenizedText(ids=joint.ids[prompt.tokens :], offsets=offsets), joint.ids[: prompt.tokens]


def truncated_count(lengths: Iterable[int], long: LongMode, room: int) -> int:
    """How many texts of ``lengths`` tokens lose tokens: under ``truncate``, those longer than the
    ``room`` one window leaves for text; under ``chunk``, none."""
    return 0 if long != "truncate" else sum(1 for n in lengths if n > room)


def _boundary(start_a: int, start_b: int, size: int) -> int:
    """First token owned by window b rather than a (a wins ties: nearest centre, earlier window)."""
    # centre_a = start_a + (size-1)/2; token p goes to a iff p - centre_a <= centre_b - p
    return (start_a + start_b + size - 1) // 2 + 1


def merged_token_rows(
    tokens: TokenizedText, special: SpecialTokens, long: LongMode, max_length: int, prompt_tokens: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and character offsets of the merged sequence the windows' token rows produce (a prompt's
    tokens are none of them, but take ``prompt_tokens`` of each window's room).

    Specials get offsets (0, 0), as in the tokenizer's own ``offset_mapping``.
    """
    content_size = max_length - special.single_overhead - prompt_tokens
    ids, offsets = tokens.ids, tokens.offsets
    if long == "truncate":
        ids, offsets = ids[:content_size], offsets[:content_size]
    pre = np.asarray(special.prefix, dtype=np.int64)
    suf = np.asarray(special.suffix, dtype=np.int64)
    all_ids = np.concatenate([pre, ids, suf])
    all_offsets = np.concatenate([np.zeros((len(pre), 2), np.int32), offsets, np.zeros((len(suf), 2), np.int32)])
    return all_ids, all_offsets


def check_stride_type(stride: object) -> None:
    """A stride is a whole number of tokens (or None: the default); 64.0 passed the range checks and failed later,
    in ``range()``, on the first text longer than one window."""
    if stride is not None and (isinstance(stride, bool) or not isinstance(stride, numbers.Integral)):
        raise ConfigError(f"stride must be a whole number of tokens, got {stride!r}")


def make_pair_window(
    item: int,
    first: np.ndarray,
    second: np.ndarray,
    special: SpecialTokens,
    max_length: int,
) -> Window:
    """One (premise, hypothesis) input, truncating only the first sequence, as transformers'
    ``truncation="only_first"`` does (the zero-shot pipeline's setting)."""
    room = max_length - special.pair_overhead - len(second)
    if room < 0 or (room == 0 and len(first) > 0):  # at 0 the first text would be dropped whole, silently
        raise ConfigError(
            f"the second text has {len(second)} tokens and leaves no room for the first in max_length {max_length}"
        )
    first = first[:room]
    parts = [special.pair_prefix, first, special.pair_middle, second, special.pair_suffix]
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    n_first = len(special.pair_prefix) + len(first) + len(special.pair_middle)
    types = np.full(len(ids), special.second_type_id, dtype=np.int64)
    types[:n_first] = special.first_type_id
    return Window(item=item, index=0, input_ids=ids, token_type_ids=types, own_start=0, own_end=len(ids))
