"""What every route group shares: the hosted runtime as a dependency, request texts, long-text modes, and
the error responses the OpenAPI document lists."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from memfit.data.chunking import LongMode
from memfit.serve.host import ServerHost
from memfit.serve.shapes import ApiError, OpenAIError, TeiError


def hosted(request: Request) -> ServerHost:
    """The loaded runtime; 503 while the model loads (or after it failed to load)."""
    state = request.app.state.server
    if state.host is None:
        raise ApiError(503, state.unavailable_reason(), "unavailable")
    return state.host


Hosted = Annotated[ServerHost, Depends(hosted)]
"""A route parameter that receives the runtime (FastAPI resolves it before the route runs)."""


def request_texts(inputs: str | list[str], runtime: ServerHost, field: str) -> list[str]:
    """``inputs`` as a list, within the items-per-request limit (413) and not empty (422)."""
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not texts:
        raise ApiError(422, f"field {field!r}: must hold at least one text", param=field)
    if len(texts) > runtime.limits.max_items:
        raise ApiError(
            413,
            f"field {field!r}: {len(texts)} items, over the limit of {runtime.limits.max_items} "
            "per request (--max-items)",
            "payload_too_large",
            field,
        )
    return texts


def long_mode(truncate: bool | None, default: LongMode, truncation_direction: str | None = None) -> LongMode:
    """A request's ``truncate`` flag as a long-text mode (``None``: the server's or route's default).

    ``truncation_direction``: TEI's field, which matters only where a request truncates. memfit truncates by
    keeping a text's first tokens, so ``Left`` (keep the last) with truncation is refused rather than answered
    from the other end of the text."""
    mode = default if truncate is None else ("truncate" if truncate else "chunk")
    if mode == "truncate" and truncation_direction is not None and truncation_direction.lower() == "left":
        raise ApiError(
            422,
            "field 'truncation_direction': memfit truncates a long text to its first tokens (Right); Left is not "
            "served (send truncate: false to read every token of a long text)",
            param="truncation_direction",
        )
    return mode


_STATUSES = {
    400: "malformed JSON, options the model refuses (labels missing or repeated, a query or hypothesis that leaves "
    "no room in the window, a route this model does not serve), or a request larger than the whole queue",
    408: "the body did not arrive within --body-timeout",
    413: "more items or a larger body than the limits allow, or a text that does not fit the memory budget",
    415: "a body not sent as application/json (the Content-Type header)",
    422: "a field missing, of another JSON type, or with a value the route cannot take (the message names it)",
    429: "the queue or the concurrency limit is full; see Retry-After",
    503: "the model is still loading",
}


def error_responses(model: type, *extra: tuple[int, str]) -> dict[int | str, dict[str, Any]]:
    """The error statuses a model route answers, each with ``model`` (the route's error shape) as its body; 401
    has OpenAI's shape on every route (``auth.py``)."""
    statuses = {**_STATUSES, **dict(extra)}
    responses = {status: {"model": model, "description": description} for status, description in statuses.items()}
    responses[401] = {"model": OpenAIError, "description": "no valid API key (a server started with keys)"}
    return dict(sorted(responses.items()))


TEI_ERRORS = error_responses(TeiError)
OPENAI_ERRORS = error_responses(OpenAIError, (404, "a model other than the one served"))
