"""What every job object (:class:`~memfit.Encoder`, :class:`~memfit.Classifier`, :class:`~memfit.Reranker`)
exposes of the :class:`~memfit.engine.runtime.Runtime` it runs on, under the names the API has always had."""

from __future__ import annotations

from memfit.engine.runtime import Runtime


class RuntimeHost:
    """A job object on a loaded runtime: what the runtime fixed at load time, read through to it (the runtime is
    replaced whole when it changes, as on the quality guard's fp32 fallback, so nothing here can go stale)."""

    runtime: Runtime

    model_name = property(lambda self: self.runtime.model_name)
    backend = property(lambda self: self.runtime.backend.name)
    backend_choice = property(lambda self: self.runtime.backend_choice)
    tokenizer = property(lambda self: self.runtime.tokenizer)
    device = property(lambda self: self.runtime.device)
    dtype = property(lambda self: self.runtime.dtype)
    max_length = property(lambda self: self.runtime.max_length)
    special = property(lambda self: self.runtime.special)
    pad_token_id = property(lambda self: self.runtime.pad_token_id)
