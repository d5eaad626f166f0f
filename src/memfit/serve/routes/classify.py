"""``/classify``: zero-shot (NLI or embedding) or a trained classifier's labels, as ``memfit classify``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from memfit.serve.routes.common import TEI_ERRORS, Hosted, long_mode, request_texts
from memfit.serve.shapes import ApiError, Classification, ClassifyRequest, guarded, json_response

router = APIRouter(tags=["classify"])


@router.post(
    "/classify",
    response_model=list[Classification],
    responses=TEI_ERRORS,
    summary="Labels of each text, best first, in the hosted model's mode",
)
async def classify(body: ClassifyRequest, request: Request, rt: Hosted) -> Response:
    texts = request_texts(body.inputs, rt, "inputs")
    if body.labels is not None and len(body.labels) > rt.limits.max_items:
        raise ApiError(
            413,
            f"field 'labels': {len(body.labels)} labels, over the limit of {rt.limits.max_items} (--max-items)",
            "payload_too_large",
            "labels",
        )
    results, lease = await guarded(
        rt.classify(
            texts,
            body.labels,
            template=body.template,
            multi_label=body.multi_label,
            long=long_mode(body.truncate, "truncate"),
            disconnected=request.is_disconnected,
        )
    )
    return json_response([{"labels": r.labels, "scores": r.scores} for r in results], lease)
