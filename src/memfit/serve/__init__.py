"""``memfit serve``: an embedding, zero-shot and rerank server with memory-budgeted dynamic batching.

- :func:`serve` runs it (blocking) on ``host:port``; SIGTERM stops accepting, lets the requests in
  flight finish, and returns.
- :func:`create_app` is the ASGI app factory, for any ASGI server.

Modules: ``runtime.py`` (the hosted model, limits, request → windows → result), ``batcher.py`` (the
dynamic batcher), ``app.py`` + ``routes/`` (the HTTP app, and its routes: one APIRouter per group),
``shapes.py`` (request and response shapes, JSON errors), ``metrics.py`` (Prometheus). See docs/serve.md.
"""

from __future__ import annotations

import logging
import signal
import threading

from memfit.serve.app import create_app
from memfit.serve.batcher import BatchingOptions
from memfit.serve.runtime import Limits, ServeOptions

log = logging.getLogger("memfit")

__all__ = ["BatchingOptions", "Limits", "ServeOptions", "create_app", "serve"]


def serve(
    options: ServeOptions = ServeOptions(),
    host: str = "127.0.0.1",
    port: int = 8000,
    graceful_timeout: float = 30.0,
    log_level: str = "warning",
) -> None:
    """Serve ``options``' model on ``host:port`` until SIGTERM or Ctrl-C.

    Raises the model's loading error (e.g. :class:`~memfit.DoesNotFitError`) if it cannot start.
    SIGTERM returns normally once the requests in flight are answered (within ``graceful_timeout``).
    """
    import uvicorn

    server: uvicorn.Server | None = None

    def stop_on_error(exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(options, on_load_error=stop_on_error)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_timeout,
        access_log=False,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles SIGTERM (stop accepting, drain, shut down) and then re-raises it to the handler
        # that was installed before it: make that one a no-op, so a SIGTERM'd server exits 0
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    error = app.state.server.load_error
    if error is not None:
        raise error
