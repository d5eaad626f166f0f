"""Request and response shapes of ``memfit serve``, its JSON errors, and the helpers routes answer with.

Shared by ``app.py`` (the app, error handlers and request guard) and ``routes.py`` (the routes); it imports
neither, so the two do not import each other.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.responses import Response

from memfit.errors import DoesNotFitError, MemfitError
from memfit.jobs.classify import DEFAULT_TEMPLATE
from memfit.serve.runtime import TRIM_AFTER_TOKENS, ClientGone, Lease, QueueFull

Texts = str | list[str]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EmbeddingsRequest(_Body):
    """OpenAI ``POST /v1/embeddings`` (plus memfit's optional ``truncate``)."""

    input: Texts
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool | None = None


class EmbedRequest(_Body):
    """TEI ``POST /embed``."""

    inputs: Texts
    normalize: bool | None = None
    truncate: bool | None = None


class EmbedAllRequest(_Body):
    """TEI ``POST /embed_all``: one vector per token (special tokens included)."""

    inputs: Texts
    truncate: bool | None = None


class TokenizeRequest(_Body):
    """TEI ``POST /tokenize``."""

    inputs: Texts
    add_special_tokens: bool = True


class ClassifyRequest(_Body):
    """``POST /classify``: zero-shot into ``labels`` (or a trained classifier's own labels)."""

    inputs: Texts
    labels: list[str] | None = None
    multi_label: bool = False
    template: str = DEFAULT_TEMPLATE
    truncate: bool | None = None  # default: truncate, as `memfit classify`


# -- errors -------------------------------------------------------------------------------------------


class ApiError(HTTPException):
    """An error answered as JSON; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.message, self.kind, self.param = message, kind, param


def error_response(path: str, status: int, message: str, kind: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    if path.startswith("/v1/"):
        body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    else:
        body = {"error": message, "error_type": kind}
    return Response(json.dumps(body), status, headers=headers, media_type="application/json")


# -- responses ----------------------------------------------------------------------------------------


def json_response(value: Any, lease: Lease | None = None, status: int = 200) -> Response:
    """A JSON response; ``lease`` (queue tokens held by the request) is released once it is sent.

    Serialised by orjson, numpy arrays as they are: a float32 is written as the shortest decimal that
    reads back to the same float32 (exact, and half the bytes of Python's float64 ``repr``), ~30x
    faster than ``json.dumps`` of ``tolist()`` (2.2 ms vs 0.08 ms for 8 vectors of 384)."""
    background = None if lease is None else BackgroundTask(_release, lease)
    return Response(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json",
                    background=background)


async def _release(lease: Lease) -> None:
    """Release on the event loop (a sync task would take a thread-pool hop per request); only a large
    request's release, which also trims the heap, goes to a thread."""
    if lease.cost >= TRIM_AFTER_TOKENS:
        await asyncio.to_thread(lease.release)
    else:
        lease.release()


def encode_vectors(vectors: np.ndarray, encoding_format: str) -> list:
    """Rows as float32 arrays (JSON float lists once serialised), or as base64 of little-endian float32
    (OpenAI's ``base64`` format)."""
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    if encoding_format == "base64":
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in vectors]
    return list(vectors)


async def guarded(call):
    """Run a runtime call, turning its refusals into HTTP errors."""
    try:
        return await call
    except QueueFull as exc:
        raise ApiError(429, str(exc), "rate_limit_error", headers={"Retry-After": str(exc.retry_after)}) from None
    except ClientGone:
        raise ApiError(499, "client disconnected", "client_closed") from None
    except DoesNotFitError as exc:
        raise ApiError(413, str(exc), "payload_too_large") from None
    except MemfitError as exc:  # ConfigError: bad labels, a route the hosted model does not serve
        raise ApiError(400, str(exc)) from None
