"""Request and response shapes of ``memfit serve``, its JSON errors, and the helpers routes answer with.

Shared by ``app.py`` (the app, error handlers and request guard) and ``routes/`` (the routes); it imports
neither, so the two do not import each other.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Annotated, Any, Literal, get_args

import numpy as np
import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo
from pydantic_core import PydanticCustomError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.responses import Response

from memfit.errors import ConfigError, DoesNotFitError, MemfitError
from memfit.jobs.classify import DEFAULT_TEMPLATE
from memfit.serve.admission import TRIM_AFTER_TOKENS, ClientGone, Lease, QueueFull


def _first_item_only(allowed: frozenset[str] | None = None):
    """A list field's check, run before pydantic's own: the first item that is not a string (or not one of
    ``allowed``) is the one error. pydantic's would list every bad item, and a 2 MB body of a million numbers (an
    OpenAI client's token ids) took 13 s on the event loop and 1.2 GiB before a 422 (session 34's review)."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list):
            for index, item in enumerate(value):
                if not isinstance(item, str):
                    raise PydanticCustomError(
                        "string_type",
                        "{field}[{index}]: Input should be a valid string, got {kind} (texts, not token ids)",
                        {"field": info.field_name, "index": index, "kind": type(item).__name__},
                    )
                if allowed is not None and item not in allowed:
                    raise PydanticCustomError(
                        "literal_error",
                        "{field}[{index}]: Input should be one of {allowed}",
                        {"field": info.field_name, "index": index, "allowed": ", ".join(sorted(allowed))},
                    )
        return value

    return BeforeValidator(check)


Texts = Annotated[str | list[str], _first_item_only()]
Strings = Annotated[list[str], _first_item_only()]
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary"]


class _Body(BaseModel):
    """A request body: each field of its own JSON type (``strict``): ``"dimensions": true`` or ``"8"`` and
    ``"normalize": "false"`` are 422s naming the field, not 1, 8 and false. Fields a route does not know are
    ignored, as text-embeddings-inference ignores them."""

    model_config = ConfigDict(extra="ignore", strict=True)


class EmbeddingsRequest(_Body):
    """OpenAI ``POST /v1/embeddings`` (plus memfit's optional ``truncate`` and TEI's ``prompt_name``)."""

    input: Texts
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate: bool | None = None
    prompt_name: str | None = None  # one of the model's prompts, as TEI's routes take it
    embedding_types: Annotated[list[EmbeddingType], _first_item_only(frozenset(get_args(EmbeddingType)))] | None = (
        Field(
            default=None,
            description="Cohere's: the vector in each type as well (data[].embeddings); int8 and uint8 need a server "
            "started with --quantization-ranges (else 422) and dimensions equal to those ranges' width",
        )
    )


TruncationDirection = Literal["Right", "right", "Left", "left"] | None
TRUNCATION_DIRECTION = Field(
    default=None,
    description="TEI's: which end of a long text a truncating request keeps; memfit keeps the first tokens "
    "(Right, the default), and a request for Left is refused (422)",
)


class EmbedRequest(_Body):
    """TEI ``POST /embed``."""

    inputs: Texts
    normalize: bool | None = None
    truncate: bool | None = None
    truncation_direction: TruncationDirection = TRUNCATION_DIRECTION
    prompt_name: str | None = None
    dimensions: int | None = Field(default=None, ge=1)


class EmbedAllRequest(_Body):
    """TEI ``POST /embed_all``: one vector per token (special tokens included)."""

    inputs: Texts
    truncate: bool | None = None
    truncation_direction: TruncationDirection = TRUNCATION_DIRECTION
    prompt_name: str | None = None


class TokenizeRequest(_Body):
    """TEI ``POST /tokenize``: the tokens of each text with the model's prompt before it, as the embedding routes
    see them (offsets count in the prompted text, as TEI's do)."""

    inputs: Texts
    add_special_tokens: bool = True
    prompt_name: str | None = None


class ClassifyRequest(_Body):
    """``POST /classify``: zero-shot into ``labels`` (or a trained classifier's own labels)."""

    inputs: Texts
    labels: Strings | None = None
    multi_label: bool = False
    template: str = DEFAULT_TEMPLATE
    truncate: bool | None = None  # default: truncate, as `memfit classify`


class RerankRequest(_Body):
    """TEI ``POST /rerank``: ``texts`` scored against ``query``, answered best first."""

    query: str
    texts: Strings
    raw_scores: bool = False  # the relevance logit (log-odds of two classes) instead of a probability
    return_text: bool = False
    truncate: bool | None = None  # true: the first window of each text; false: every window (best counts)
    truncation_direction: TruncationDirection = TRUNCATION_DIRECTION


class CohereRerankRequest(_Body):
    """Cohere's and infinity's ``POST /v1/rerank`` (plus memfit's optional ``raw_scores`` and ``truncate``)."""

    query: str
    documents: Strings
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    model: str | None = None
    raw_scores: bool = False
    truncate: bool | None = None


# -- responses, as the OpenAPI document describes them (routes answer with json_response) --------------


class Usage(BaseModel):
    prompt_tokens: int = Field(
        description="every token run through the model: special tokens and window overlaps included"
    )
    total_tokens: int


class EmbeddingObject(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")
    embeddings: dict[str, list[float] | list[int]] | None = Field(
        default=None,
        description="with embedding_types: the vector in each type asked for, as sentence-transformers' "
        "quantize_embeddings makes it: int8 / uint8 one level (-128..127 / 0..255) per dimension within the "
        "per-dimension ranges of --quantization-ranges (those a memfit embed --output-dtype int8 run calibrated "
        "on its corpus); binary / ubinary sign bits packed 8 per byte",
    )


class EmbeddingsResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingObject]
    model: str
    usage: Usage


class ModelObject(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelsResponse(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]


class TokenObject(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="character offset in the text; null for a special token")
    stop: int | None


class Classification(BaseModel):
    labels: list[str] = Field(description="best first")
    scores: list[float] = Field(description="in the order of labels")


class RerankHit(BaseModel):
    index: int = Field(description="position of the text in the request")
    score: float
    text: str | None = Field(default=None, description="with return_text")


class RerankResult(BaseModel):
    index: int = Field(description="position of the document in the request")
    relevance_score: float
    document: str | None = Field(default=None, description="with return_documents")


class RerankResponse(BaseModel):
    object: Literal["rerank"]
    model: str
    results: list[RerankResult] = Field(description="best first, at most top_n")
    usage: Usage


class Info(BaseModel):
    """``GET /info``: the model, its window and the limits in force (TEI's field names where TEI has one)."""

    model_id: str
    model_path: str
    model_type: Literal["embedding", "classifier"]
    mode: Literal["nli", "embedding", "supervised"]
    reranker: bool = Field(description="whether /rerank and /v1/rerank are served (a cross-encoder)")
    model_dtype: str
    backend: str = Field(description="what runs the model: a `--backend` name (docs/architecture.md)")
    backend_choice: str = Field(
        description="why that backend runs: asked for by name, or `auto`'s pick (measured per CPU, docs/precision.md)"
    )
    device: str
    dim: int | None
    pooling: str | None
    normalize: bool
    long: Literal["truncate", "chunk"]
    stride: int | None
    max_input_length: int
    max_batch_tokens: int
    max_client_batch_size: int
    max_body_bytes: int
    max_concurrent_requests: int
    max_queue_tokens: int
    memory_budget_bytes: int
    memory_baseline_bytes: int
    memory_plan: str
    version: str


class TeiError(BaseModel):
    """An error outside ``/v1/`` (text-embeddings-inference's shape)."""

    error: str
    error_type: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class OpenAIError(BaseModel):
    """An error under ``/v1/`` (OpenAI's shape)."""

    error: OpenAIErrorDetail


# -- errors -------------------------------------------------------------------------------------------


class ApiError(HTTPException):
    """An error answered as JSON; ``param`` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(status, message, headers)
        self.message, self.kind, self.param = message, kind, param


def error_response(
    path: str, status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
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
    return Response(
        orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY),
        status,
        media_type="application/json",
        background=background,
    )


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
    except ConfigError as exc:
        if exc.field is None:  # an option the model refuses as a whole (labels repeated, no route for it)
            raise ApiError(400, str(exc)) from None
        raise ApiError(422, f"field {exc.field!r}: {exc}", param=exc.field) from None
    except MemfitError as exc:
        raise ApiError(400, str(exc)) from None
