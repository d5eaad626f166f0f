"""``/rerank`` (text-embeddings-inference's shape) and ``/v1/rerank`` (Cohere's and infinity's): documents
scored against a query by the hosted cross-encoder, best first, as ``memfit rerank`` scores them."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from memfit.jobs.rerank import ranking
from memfit.serve.routes.common import OPENAI_ERRORS, TEI_ERRORS, Hosted, long_mode, request_texts
from memfit.serve.routes.openai import check_model
from memfit.serve.shapes import (
    CohereRerankRequest,
    RerankHit,
    RerankRequest,
    RerankResponse,
    guarded,
    json_response,
)

router = APIRouter(tags=["rerank"])


@router.post(
    "/rerank",
    response_model=list[RerankHit],
    responses=TEI_ERRORS,
    summary="Texts scored against a query, best first (TEI)",
)
async def rerank(body: RerankRequest, request: Request, rt: Hosted) -> Response:
    texts = request_texts(body.texts, rt, "texts")
    block, lease = await guarded(
        rt.rerank(
            body.query,
            texts,
            raw=body.raw_scores,
            long=long_mode(body.truncate, rt.options.long, body.truncation_direction),
            disconnected=request.is_disconnected,
        )
    )
    hits = []
    for i in ranking(block.scores):
        hit = {"index": i, "score": float(block.scores[i])}
        if body.return_text:
            hit["text"] = texts[i]
        hits.append(hit)
    return json_response(hits, lease)


@router.post(
    "/v1/rerank",
    response_model=RerankResponse,
    responses=OPENAI_ERRORS,
    summary="Documents scored against a query, best first (Cohere, infinity)",
)
async def cohere_rerank(body: CohereRerankRequest, request: Request, rt: Hosted) -> Response:
    documents = request_texts(body.documents, rt, "documents")
    check_model(body.model, rt)
    block, lease = await guarded(
        rt.rerank(
            body.query,
            documents,
            raw=body.raw_scores,
            long=long_mode(body.truncate, rt.options.long),
            disconnected=request.is_disconnected,
        )
    )
    results = []
    for i in ranking(block.scores, body.top_n):
        result = {"index": i, "relevance_score": float(block.scores[i])}
        if body.return_documents:
            result["document"] = documents[i]
        results.append(result)
    tokens = block.counts.tokens
    return json_response(
        {
            "object": "rerank",
            "model": rt.served_name,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        lease,
    )
