"""OpenAI's ``/v1/models`` and ``/v1/embeddings`` (the official ``openai`` client works as is)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from memfit.io.vector_codec import CALIBRATED, VectorCodec
from memfit.serve.routes.common import OPENAI_ERRORS, Hosted, long_mode, request_texts
from memfit.serve.shapes import (
    ApiError,
    EmbeddingsRequest,
    EmbeddingsResponse,
    ModelsResponse,
    encode_vectors,
    guarded,
    json_response,
)

router = APIRouter(tags=["OpenAI"])


def check_model(requested: str | None, rt: Hosted) -> None:
    """A request's ``model``, when given, must be the served one (404 otherwise, as OpenAI answers)."""
    if requested is not None and requested != rt.served_name:
        raise ApiError(
            404, f"model {requested!r} is not served here; this server serves {rt.served_name!r}", param="model"
        )


def embedding_codecs(types: list[str]) -> dict[str, VectorCodec]:
    """Cohere's ``embedding_types``: each type's encoder, the one ``memfit embed --output-dtype`` stores with.
    int8 / uint8 are refused: their ranges come from calibration embeddings, which one request does not
    provide (``memfit embed --output-dtype int8`` calibrates on a corpus and records the ranges)."""
    for name in types:
        if name in CALIBRATED:
            raise ApiError(
                422,
                f"field 'embedding_types': {name} needs calibration ranges from a corpus, which one request does "
                "not provide; ask for float, binary or ubinary (memfit embed --output-dtype int8 calibrates)",
                param="embedding_types",
            )
    return {name: VectorCodec("float32" if name == "float" else name) for name in dict.fromkeys(types)}


@router.get("/v1/models", response_model=ModelsResponse, summary="The served model", responses=OPENAI_ERRORS)
async def models(rt: Hosted) -> Response:
    return json_response(
        {"object": "list", "data": [{"id": rt.served_name, "object": "model", "created": 0, "owned_by": "memfit"}]}
    )


@router.post(
    "/v1/embeddings", response_model=EmbeddingsResponse, summary="Embed texts (OpenAI)", responses=OPENAI_ERRORS
)
async def embeddings(body: EmbeddingsRequest, request: Request, rt: Hosted) -> Response:
    texts = request_texts(body.input, rt, "input")
    check_model(body.model, rt)
    codecs = embedding_codecs(body.embedding_types or [])
    block, lease = await guarded(
        rt.embed(
            texts,
            normalize=rt.options.normalize,  # after shortening to `dimensions`, as OpenAI does
            long=long_mode(body.truncate, rt.options.long),
            tokens=False,
            disconnected=request.is_disconnected,
            prompt_name=body.prompt_name,
            dimensions=body.dimensions,
        )
    )
    vectors = block.pooled
    data = [
        {"object": "embedding", "index": i, "embedding": v}
        for i, v in enumerate(encode_vectors(vectors, body.encoding_format))
    ]
    if codecs:
        typed = {name: codec.encode(vectors) for name, codec in codecs.items()}
        for i, item in enumerate(data):
            item["embeddings"] = {name: values[i] for name, values in typed.items()}
    tokens = block.counts.tokens
    return json_response(
        {
            "object": "list",
            "data": data,
            "model": rt.served_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        lease,
    )
