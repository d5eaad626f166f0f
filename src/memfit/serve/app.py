"""The HTTP face of ``memfit serve``: the app, its error handlers and the request guard (the routes are in
``routes/`` (one APIRouter per group), request and response shapes and JSON errors in ``shapes.py``).

Shapes follow their conventions: OpenAI for ``/v1/embeddings`` and ``/v1/models``; text-embeddings-
inference (TEI) for ``/embed``, ``/embed_all``, ``/tokenize``, ``/rerank`` and ``/info``; Cohere's and
infinity's for ``/v1/rerank``; ``/classify`` answers like transformers' zero-shot pipeline (labels best
first, with their scores). ``/openapi.json`` describes them all, ``/docs`` renders it offline. Errors are JSON: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` under ``/v1/``, TEI's ``{"error", "error_type"}``
elsewhere.

The model loads in a background thread after the server starts listening: ``/health`` (liveness) answers 200
from the start, ``/ready`` 503 until the model is loaded and every model worker has run its first batch (every
model route answers 503 meanwhile), and 503 again once SIGTERM starts draining. With API keys
(``ServeOptions.api_keys``) every other route needs one (``auth.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memfit.defaults import VERSION
from memfit.errors import ConfigError
from memfit.io.vector_codec import read_calibration
from memfit.serve import routes
from memfit.serve.auth import ApiKeyGuard, check_api_keys
from memfit.serve.host import ServerHost
from memfit.serve.options import ServeOptions, configure_server_process
from memfit.serve.shapes import ApiError, error_response

log = logging.getLogger("memfit")

ROUTES = (
    "/health",
    "/ready",
    "/info",
    "/metrics",
    "/v1/models",
    "/v1/embeddings",
    "/embed",
    "/embed_all",
    "/tokenize",
    "/classify",
    "/rerank",
    "/v1/rerank",
    "/docs",
    "/openapi.json",
)
"""The paths ``/metrics`` counts by name (assets and unknown paths count as ``other``)."""

PROBES = frozenset({"/health", "/ready", "/metrics"})
"""Paths that answer past ``--max-concurrent-requests``: they take no body and no model time, and a liveness probe
or a Prometheus scrape refused under load would have the server restarted or its load go unseen just when it
matters."""


# -- errors -------------------------------------------------------------------------------------------


def _field_path(loc: tuple) -> str:
    """``('body', 'inputs', 'list[str]', 3)`` → ``inputs[3]``: pydantic's union-branch tags left out."""
    path = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = str(part)
        elif "[" not in str(part) and str(part) not in ("str", "int", "float", "bool"):
            path += f".{part}"
    return path or "body"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        content_type = request.headers.get("content-type", "")
        media = content_type.split(";", 1)[0].strip().lower()
        if request.method == "POST" and media != "application/json" and not media.endswith("+json"):
            # FastAPI reads no other body as JSON: say so, not that the (unread) body is not an object
            return error_response(
                request.url.path,
                415,
                f"header 'Content-Type': the body must be sent as application/json; got {content_type or 'none'!r}",
                "invalid_request_error",
                "Content-Type",
            )
        # the deepest location is the most specific (a list item rather than the union's str branch)
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        if first.get("type") == "json_invalid":
            position = first.get("loc", ("body", "?"))[-1]
            detail = first.get("ctx", {}).get("error", "invalid JSON")
            return error_response(
                request.url.path,
                400,
                f"malformed JSON body at position {position}: {detail}",
                "invalid_request_error",
                "body",
            )
        field = _field_path(tuple(first.get("loc", ())))
        return error_response(
            request.url.path, 422, f"field {field!r}: {first.get('msg')}", "invalid_request_error", field
        )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if isinstance(exc, ApiError):
            return error_response(request.url.path, exc.status_code, exc.message, exc.kind, exc.param, exc.headers)
        return error_response(
            request.url.path, exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


# -- the guard: concurrency, body size, latency metrics --------------------------------------------------


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(
            413, f"request body over the {limit}-byte limit (--max-body-bytes)", "payload_too_large", "body"
        )


class BodyTimeout(ApiError):
    def __init__(self, seconds: float):
        super().__init__(408, f"request body not received within {seconds:g} s (--body-timeout)", param="body")


class RequestGuard:
    """ASGI middleware: refuses requests over the concurrency limit (429; the probes in :data:`PROBES` always
    answer), the body limit (413, counted as the body streams in, whatever Content-Length claims) or the body's
    time limit (408: a client that trickles or stalls its body would otherwise hold a request slot for ever), and
    times every request."""

    def __init__(self, app: ASGIApp, state: "ServerState"):
        self.app = app
        self.state = state
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = self.state.host
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if host is None:  # loading: the limits come with the model, and every POST route needs it
            if scope["method"] == "POST":  # refused before its body is read (FastAPI would read and parse it all)
                await error_response(scope["path"], 503, self.state.unavailable_reason(), "unavailable")(
                    scope, receive, send
                )
                return
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        limits = host.limits
        started = time.perf_counter()
        status = {"code": 500}

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.in_flight >= limits.max_concurrent_requests and path not in PROBES:
                host.metrics.rejected.labels("concurrency").inc()
                await error_response(
                    path,
                    429,
                    f"more than {limits.max_concurrent_requests} requests in flight "
                    "(--max-concurrent-requests); retry later",
                    "rate_limit_error",
                    headers={"Retry-After": "1"},
                )(scope, receive, send_counted)
                return
            length = dict(scope.get("headers", [])).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
                host.metrics.rejected.labels("body_size").inc()
                await error_response(
                    path, 413, BodyTooLarge(limits.max_body_bytes).message, "payload_too_large", "body"
                )(scope, receive, send_counted)
                return
            self.in_flight += 1
            received = 0
            body_timeout = host.options.body_timeout
            body_deadline = time.monotonic() + body_timeout
            body_done = False

            async def receive_limited() -> Message:
                nonlocal received, body_done
                if body_done:  # later receives wait for a disconnect: no time limit
                    return await receive()
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, body_deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    host.metrics.rejected.labels("body_timeout").inc()
                    raise BodyTimeout(body_timeout) from None
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    body_done = not message.get("more_body", False)
                    if received > limits.max_body_bytes:
                        host.metrics.rejected.labels("body_size").inc()
                        raise BodyTooLarge(limits.max_body_bytes)
                return message

            try:
                await self.app(scope, receive_limited, send_counted)
            finally:
                self.in_flight -= 1
        finally:
            host.metrics.request_seconds.labels(route).observe(time.perf_counter() - started)
            host.metrics.requests.labels(route, str(status["code"])).inc()


# -- the app --------------------------------------------------------------------------------------------


class ServerState:
    """The server's host once its model is loaded (None until then), or the error that stopped it loading;
    ``draining`` once the server was told to stop (``/ready`` then answers 503 while the requests in flight
    finish)."""

    def __init__(self) -> None:
        self.host: ServerHost | None = None
        self.load_error: BaseException | None = None
        self.draining = False

    def unavailable_reason(self) -> str:
        """Why a request that needs the model cannot have it yet (or ever)."""
        if self.load_error is None:
            return "the model is still loading"
        return f"the model failed to load: {self.load_error}"


def create_app(
    options: ServeOptions = ServeOptions(),
    host: ServerHost | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The ASGI app. Without ``host`` the model is loaded in a background thread at start-up (/ready
    answers 503 until it is ready); ``on_load_error`` is told if that fails (the CLI then shuts down).
    ``options.quantization_ranges`` is read here, so a path without ranges is refused before the model loads."""
    check_api_keys(options.api_keys)
    if not options.body_timeout > 0:
        raise ConfigError(f"--body-timeout must be more than 0 seconds, got {options.body_timeout}")
    calibration = None
    if host is None and options.quantization_ranges is not None:
        calibration = read_calibration(options.quantization_ranges)
    state = ServerState()
    state.host = host

    def load() -> None:
        try:
            configure_server_process(options)
            state.host = ServerHost(options, calibration=calibration)
            log.warning("memfit serve: model loaded and calibrated; ready")
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, who decides the exit
            state.load_error = exc
            log.error("memfit serve: cannot start: %s", exc)
            if on_load_error is not None:
                on_load_error(exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if state.host is None:
            loader = threading.Thread(target=load, name="memfit-load", daemon=True)
            loader.start()
        try:
            yield
        finally:
            if loader is not None:
                loader.join()
            if state.host is not None and host is None:  # a host we built is ours to stop
                state.host.close()

    app = FastAPI(
        title="memfit serve",
        version=VERSION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        description=API_DESCRIPTION,
    )
    # the last added runs first: a request without a key is refused before it holds a slot or sends its body
    app.add_middleware(RequestGuard, state=state)
    app.add_middleware(
        ApiKeyGuard,
        keys=options.api_keys,
        public_metrics_and_docs=options.public_metrics_and_docs,
        on_refused=lambda: _count_refusal(state),
    )
    _install_error_handlers(app)
    app.state.server = state  # what the routes' Hosted dependency reads
    for router in routes.ROUTERS:
        app.include_router(router)
    routes.docs.mount_assets(app)
    return app


def _count_refusal(state: ServerState) -> None:
    """A request refused for its key, in ``memfit_rejected_requests_total{reason="unauthorized"}``."""
    if state.host is not None:
        state.host.metrics.rejected.labels("unauthorized").inc()


API_DESCRIPTION = (
    "Embeddings (OpenAI and text-embeddings-inference routes), zero-shot classification and reranking within a "
    "memory budget. Errors are JSON: OpenAI's shape under /v1/, TEI's elsewhere. See docs/serve.md."
)
