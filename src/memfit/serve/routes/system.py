"""``/health``, ``/ready``, ``/info`` and ``/metrics``: whether the server is alive and ready, what it hosts, how
it is doing.

``/health`` is the liveness probe (the process answers: 200 while the model loads too, 503 only once loading
failed, when a restart is what helps); ``/ready`` is the readiness probe (200 once the model is loaded and every
worker has run its first batch, 503 while warming up or draining), as Kubernetes' two probes expect."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from memfit.defaults import VERSION
from memfit.serve.routes.common import Hosted, hosted
from memfit.serve.shapes import ApiError, Info, TeiError, json_response

router = APIRouter(tags=["server"])


@router.get(
    "/health",
    response_class=Response,
    summary="Alive (the liveness probe)",
    responses={
        200: {"description": "the process serves requests (the model may still be loading; see /ready)"},
        503: {"model": TeiError, "description": "the model failed to load: restart"},
    },
)
async def health(request: Request) -> Response:
    state = request.app.state.server
    if state.load_error is not None:
        raise ApiError(503, f"the model failed to load: {state.load_error}", "unavailable")
    return Response(status_code=200)


@router.get(
    "/ready",
    response_class=Response,
    summary="Ready for traffic (the readiness probe)",
    responses={
        200: {"description": "the model is loaded and every worker has run its first batch (no body)"},
        503: {"model": TeiError, "description": "warming up, draining after SIGTERM, or the model failed to load"},
    },
)
async def ready(request: Request) -> Response:
    state = request.app.state.server
    if state.draining:
        raise ApiError(503, "draining: the server is shutting down", "unavailable")
    hosted(request)  # 503 while the model loads or warms up
    return Response(status_code=200)


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        503: {"model": TeiError, "description": "the model is still loading"},
    },
)
async def metrics(rt: Hosted) -> Response:
    return Response(rt.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/info",
    response_model=Info,
    summary="The hosted model, its window and the limits in force",
    responses={503: {"model": TeiError, "description": "the model is still loading"}},
)
async def info(rt: Hosted) -> Response:
    memory, limits = rt.memory, rt.limits
    return json_response(
        {
            "model_id": rt.served_name,
            "model_path": rt.model_name,
            "model_type": "embedding" if rt.encoder is not None else "classifier",
            "mode": rt.classifier.mode,
            "reranker": rt.reranker is not None,
            "model_dtype": rt.classifier.dtype,
            "backend": rt.classifier.backend,
            "backend_choice": rt.classifier.backend_choice,
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
        }
    )
