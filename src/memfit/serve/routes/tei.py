"""text-embeddings-inference's ``/embed``, ``/embed_all`` and ``/tokenize``."""

from __future__ import annotations

import asyncio
from typing import Callable

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from memfit.serve.routes.common import TEI_ERRORS, Hosted, long_mode, request_texts
from memfit.serve.shapes import (
    EmbedAllRequest,
    EmbedRequest,
    TokenizeRequest,
    TokenObject,
    encode_vectors,
    guarded,
    json_response,
)

router = APIRouter(tags=["text-embeddings-inference"])


@router.post(
    "/embed", response_model=list[list[float]], summary="Pooled vectors, one per text (TEI)", responses=TEI_ERRORS
)
async def embed(body: EmbedRequest, request: Request, rt: Hosted) -> Response:
    texts = request_texts(body.inputs, rt, "inputs")
    normalize = rt.options.normalize if body.normalize is None else body.normalize
    block, lease = await guarded(
        rt.embed(
            texts,
            normalize=normalize,
            long=long_mode(body.truncate, rt.options.long, body.truncation_direction),
            tokens=False,
            disconnected=request.is_disconnected,
            prompt_name=body.prompt_name,
            dimensions=body.dimensions,
        )
    )
    return json_response(encode_vectors(block.pooled, "float"), lease)


@router.post(
    "/embed_all",
    response_model=list[list[list[float]]],
    responses=TEI_ERRORS,
    summary="One vector per token, special tokens included (TEI)",
)
async def embed_all(body: EmbedAllRequest, request: Request, rt: Hosted) -> Response:
    texts = request_texts(body.inputs, rt, "inputs")
    block, lease = await guarded(
        rt.embed(
            texts,
            normalize=False,
            long=long_mode(body.truncate, rt.options.long, body.truncation_direction),
            tokens=True,
            disconnected=request.is_disconnected,
            prompt_name=body.prompt_name,
        )
    )
    return json_response([np.ascontiguousarray(t.embeddings, dtype="<f4") for t in block.tokens], lease)


@router.post(
    "/tokenize",
    response_model=list[list[TokenObject]],
    summary="Tokens with character offsets (TEI)",
    responses=TEI_ERRORS,
)
async def tokenize(body: TokenizeRequest, rt: Hosted) -> Response:
    texts = request_texts(body.inputs, rt, "inputs")
    texts, tokenized, lease = await guarded(rt.tokenize(texts, body.prompt_name))
    try:  # a dict per token, up to the queue's capacity of them: built off the event loop
        out = await asyncio.to_thread(
            _token_objects, texts, tokenized, rt.encoder.tokenizer.convert_ids_to_tokens, body.add_special_tokens
        )
    except BaseException:
        lease.release()
        raise
    return json_response(out, lease)


def _token_objects(
    texts: list[str],
    tokenized: list[tuple[np.ndarray, np.ndarray, int, int]],
    names: Callable[[list[int]], list[str]],
    add_special_tokens: bool,
) -> list[list[dict]]:
    """TEI's token objects of each text: id, text (a special token's name, else the text it covers), offsets."""
    out = []
    for text, (ids, offsets, n_prefix, n_suffix) in zip(texts, tokenized):
        n = len(ids)
        keep = range(n) if add_special_tokens else range(n_prefix, n - n_suffix)
        pieces = names(ids.tolist())
        out.append(
            [
                {
                    "id": int(ids[i]),
                    "text": pieces[i] if i < n_prefix or i >= n - n_suffix else text[offsets[i, 0] : offsets[i, 1]],
                    "special": i < n_prefix or i >= n - n_suffix,
                    "start": None if i < n_prefix or i >= n - n_suffix else int(offsets[i, 0]),
                    "stop": None if i < n_prefix or i >= n - n_suffix else int(offsets[i, 1]),
                }
                for i in keep
            ]
        )
    return out
