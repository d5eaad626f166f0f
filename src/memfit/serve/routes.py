"""The routes of ``memfit serve`` (shapes and errors are described in ``shapes.py`` and docs/serve.md)."""

from __future__ import annotations

from typing import Callable

import numpy as np
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from memfit.data.chunking import LongMode
from memfit.defaults import VERSION
from memfit.engine.pooling import l2_normalize
from memfit.serve.shapes import (
    ApiError,
    ClassifyRequest,
    EmbedAllRequest,
    EmbeddingsRequest,
    EmbedRequest,
    TokenizeRequest,
    encode_vectors,
    guarded,
    json_response,
)
from memfit.serve.runtime import Runtime


def _texts(inputs: str | list[str], runtime: Runtime, field: str) -> list[str]:
    """``inputs`` as a list, within the items-per-request limit (413) and not empty (422)."""
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not texts:
        raise ApiError(422, f"field {field!r}: must hold at least one text", param=field)
    if len(texts) > runtime.limits.max_items:
        raise ApiError(413, f"field {field!r}: {len(texts)} items, over the limit of {runtime.limits.max_items} "
                            "per request (--max-items)", "payload_too_large", field)
    return texts


def _long(truncate: bool | None, default: LongMode) -> LongMode:
    """A request's ``truncate`` flag as a long-text mode (``None``: the server's or route's default)."""
    return default if truncate is None else ("truncate" if truncate else "chunk")


def register(app: FastAPI, ready: Callable[[], Runtime]) -> None:
    @app.get("/health")
    async def health() -> Response:
        ready()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ready().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/info")
    async def info() -> Response:
        rt = ready()
        memory, limits = rt.memory, rt.limits
        return json_response({
            "model_id": rt.served_name,
            "model_path": rt.model_name,
            "model_type": "embedding" if rt.encoder is not None else "classifier",
            "mode": rt.classifier.mode,
            "model_dtype": rt.classifier.dtype,
            "device": str(rt.classifier.device),
            "dim": None if rt.encoder is None else rt.encoder.dim,
            "pooling": None if rt.encoder is None else rt.encoder.default_pooling,
            "normalize": rt.options.normalize,
            "long": rt.options.long,
            "stride": rt.stride,
            "max_input_length": rt.max_length,
            "max_batch_tokens": memory.batch_budget.max_batch_tokens,
            "max_client_batch_size": limits.max_items,
            "max_body_bytes": limits.max_body_bytes,
            "max_concurrent_requests": limits.max_concurrent_requests,
            "max_queue_tokens": limits.max_queue_tokens,
            "memory_budget_bytes": memory.budget_bytes,
            "memory_baseline_bytes": memory.baseline_bytes,
            "memory_plan": memory.describe(),
            "version": VERSION,
        })

    @app.get("/v1/models")
    async def models() -> Response:
        rt = ready()
        return json_response({"object": "list", "data": [
            {"id": rt.served_name, "object": "model", "created": 0, "owned_by": "memfit"}]})

    @app.post("/v1/embeddings")
    async def openai_embeddings(body: EmbeddingsRequest, request: Request) -> Response:
        rt = ready()
        texts = _texts(body.input, rt, "input")
        if body.model is not None and body.model != rt.served_name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {rt.served_name!r}",
                           param="model")
        dim = rt.encoder.dim if rt.encoder is not None else 0
        if body.dimensions is not None and body.dimensions > dim:
            raise ApiError(422, f"field 'dimensions': {body.dimensions} is more than the model's {dim}",
                           param="dimensions")
        normalize = rt.options.normalize
        block, lease = await guarded(rt.embed(texts, normalize=normalize and body.dimensions is None,
                                              long=_long(body.truncate, rt.options.long), tokens=False,
                                              disconnected=request.is_disconnected))
        vectors = block.pooled
        if body.dimensions is not None:  # shortened as OpenAI does: the leading dimensions, re-normalized
            vectors = vectors[:, : body.dimensions]
            vectors = l2_normalize(vectors) if normalize else vectors
        data = [{"object": "embedding", "index": i, "embedding": v}
                for i, v in enumerate(encode_vectors(vectors, body.encoding_format))]
        tokens = block.counts.tokens
        return json_response({"object": "list", "data": data, "model": rt.served_name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, lease)

    @app.post("/embed")
    async def tei_embed(body: EmbedRequest, request: Request) -> Response:
        rt = ready()
        texts = _texts(body.inputs, rt, "inputs")
        normalize = rt.options.normalize if body.normalize is None else body.normalize
        long = _long(body.truncate, rt.options.long)
        block, lease = await guarded(rt.embed(texts, normalize=normalize, long=long, tokens=False,
                                              disconnected=request.is_disconnected))
        return json_response(encode_vectors(block.pooled, "float"), lease)

    @app.post("/embed_all")
    async def tei_embed_all(body: EmbedAllRequest, request: Request) -> Response:
        rt = ready()
        texts = _texts(body.inputs, rt, "inputs")
        block, lease = await guarded(rt.embed(texts, normalize=False, long=_long(body.truncate, rt.options.long),
                                              tokens=True, disconnected=request.is_disconnected))
        return json_response([np.ascontiguousarray(t.embeddings, dtype="<f4") for t in block.tokens], lease)

    @app.post("/tokenize")
    async def tei_tokenize(body: TokenizeRequest) -> Response:
        rt = ready()
        texts = _texts(body.inputs, rt, "inputs")
        tokenized, lease = await guarded(rt.tokenize(texts))
        names = rt.encoder.tokenizer.convert_ids_to_tokens
        out = []
        for text, (ids, offsets, n_prefix, n_suffix) in zip(texts, tokenized):
            n = len(ids)
            keep = range(n) if body.add_special_tokens else range(n_prefix, n - n_suffix)
            pieces = names(ids.tolist())
            out.append([{
                "id": int(ids[i]),
                "text": pieces[i] if i < n_prefix or i >= n - n_suffix else text[offsets[i, 0]:offsets[i, 1]],
                "special": i < n_prefix or i >= n - n_suffix,
                "start": None if i < n_prefix or i >= n - n_suffix else int(offsets[i, 0]),
                "stop": None if i < n_prefix or i >= n - n_suffix else int(offsets[i, 1]),
            } for i in keep])
        return json_response(out, lease)

    @app.post("/classify")
    async def classify(body: ClassifyRequest, request: Request) -> Response:
        rt = ready()
        texts = _texts(body.inputs, rt, "inputs")
        if body.labels is not None and len(body.labels) > rt.limits.max_items:
            raise ApiError(413, f"field 'labels': {len(body.labels)} labels, over the limit of "
                                f"{rt.limits.max_items} (--max-items)", "payload_too_large", "labels")
        results, lease = await guarded(rt.classify(texts, body.labels, template=body.template,
                                                   multi_label=body.multi_label,
                                                   long=_long(body.truncate, "truncate"),
                                                   disconnected=request.is_disconnected))
        return json_response([{"labels": r.labels, "scores": r.scores} for r in results], lease)
