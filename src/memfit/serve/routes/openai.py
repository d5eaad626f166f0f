"""OpenAI's ``/v1/models`` and ``/v1/embeddings`` (the official ``openai`` client works as is)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from memfit.io.vector_codec import CALIBRATED, VectorCodec
from memfit.serve.host import ServerHost
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


def embedding_codecs(types: list[str], rt: ServerHost, dimensions: int | None) -> dict[str, VectorCodec]:
    """Cohere's ``embedding_types``: each type's encoder, the one ``memfit embed --output-dtype`` stores with.
    int8 / uint8 quantize with the ranges of ``--quantization-ranges`` (calibration embeddings, which one request
    does not provide: a ``memfit embed --output-dtype int8`` run calibrates on a corpus and records them), so a
    query is quantized as that corpus's stored vectors were; without them they are refused."""
    codecs = {}
    for name in dict.fromkeys(types):
        if name not in CALIBRATED:
            codecs[name] = VectorCodec("float32" if name == "float" else name)
            continue
        if rt.calibration is None:
            raise ApiError(
                422,
                f"field 'embedding_types': {name} needs calibration ranges from a corpus, which one request does "
                "not provide; ask for float, binary or ubinary, or start the server with --quantization-ranges DIR, "
                "the output of a 'memfit embed --output-dtype int8' (or uint8) run over the corpus",
                param="embedding_types",
            )
        width = rt.calibration.width  # a server with ranges hosts an encoder (checked at start-up)
        if (dimensions or rt.encoder.dim) != width:
            leave_out = " (or left out)" if width == rt.encoder.dim else ""
            raise ApiError(
                422,
                f"field 'dimensions': {name} quantizes with the ranges of --quantization-ranges, calibrated on vectors "
                f"of {width} dimensions, so dimensions must be {width}{leave_out} to ask for it",
                param="dimensions",
            )
        codecs[name] = rt.calibration.codec(name)
    return codecs


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
    codecs = embedding_codecs(body.embedding_types or [], rt, body.dimensions)
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
