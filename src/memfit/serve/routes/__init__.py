"""The routes of ``memfit serve``, one :class:`~fastapi.APIRouter` per group (shapes and errors are described in
``shapes.py`` and docs/serve.md):

- ``system.py``: ``/health``, ``/info``, ``/metrics``;
- ``openai.py``: OpenAI's ``/v1/models`` and ``/v1/embeddings``;
- ``tei.py``: text-embeddings-inference's ``/embed``, ``/embed_all`` and ``/tokenize``;
- ``classify.py``: ``/classify``;
- ``rerank.py``: TEI's ``/rerank`` and Cohere's / infinity's ``/v1/rerank``;
- ``docs.py``: the Swagger UI page ``/docs`` over FastAPI's ``/openapi.json``, from assets shipped in a package.

Every model route reaches the hosted runtime through the ``Hosted`` dependency (``common.py``): 503 until the
model is loaded.
"""

from __future__ import annotations

from memfit.serve.routes import classify, docs, openai, rerank, system, tei

ROUTERS = (system.router, openai.router, tei.router, classify.router, rerank.router, docs.router)
"""In the order the OpenAPI document (and /docs) lists them."""

__all__ = ["ROUTERS", "docs"]
