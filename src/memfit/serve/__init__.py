"""``memfit serve``: an embedding, zero-shot and rerank server with memory-budgeted dynamic batching.

- :func:`serve` runs it (blocking) on ``host:port`` (over TLS with a certificate); SIGTERM turns ``/ready`` to
  503, stops accepting (after ``shutdown_delay``), lets the requests in flight finish, and returns.
- :func:`create_app` is the ASGI app factory, for any ASGI server.

Modules: ``host.py`` (:class:`ServerHost`: the hosted model, request → windows → result), ``options.py`` (the
server's options and limits), ``admission.py`` (what a server holds at once), ``batcher.py`` (the dynamic
batcher), ``app.py`` + ``routes/`` (the HTTP app, and its routes: one APIRouter per group), ``shapes.py``
(request and response shapes, JSON errors), ``metrics.py`` (Prometheus), ``auth.py`` (API keys).
See docs/serve.md.
"""

from __future__ import annotations

import logging
import signal
import ssl
import threading
from types import FrameType

import uvicorn

from memfit.errors import ConfigError
from memfit.serve.app import ServerState, create_app
from memfit.serve.auth import startup_lines
from memfit.serve.batcher import BatchingOptions
from memfit.serve.options import Limits, ServeOptions

log = logging.getLogger("memfit")

__all__ = ["BatchingOptions", "Limits", "ServeOptions", "create_app", "serve"]


def serve(
    options: ServeOptions = ServeOptions(),
    host: str = "127.0.0.1",
    port: int = 8000,
    graceful_timeout: float = 30.0,
    log_level: str = "warning",
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    shutdown_delay: float = 0.0,
) -> None:
    """Serve ``options``' model on ``host:port`` until SIGTERM or Ctrl-C (over TLS with ``ssl_certfile``).

    SIGTERM turns ``/ready`` to 503 at once, keeps serving ``shutdown_delay`` seconds (time for a load balancer
    to stop sending), then stops accepting and returns once the requests in flight are answered (within
    ``graceful_timeout``). Raises the model's loading error (e.g. :class:`~memfit.DoesNotFitError`) if it cannot
    start, :class:`~memfit.errors.ConfigError` for keys or TLS files that cannot be used.
    """
    check_tls_files(ssl_certfile, ssl_keyfile)
    if not 0 <= port <= 65535:  # uvicorn would raise OverflowError, or a host name would wrap it to another port
        raise ConfigError(f"--port must be between 0 and 65535, got {port}")
    if shutdown_delay < 0:
        raise ConfigError(f"--shutdown-delay must be at least 0 seconds, got {shutdown_delay}")
    info, warning = startup_lines(host, options.api_keys, options.public_metrics_and_docs)
    for line in (info, warning):
        if line is not None:
            log.warning("memfit serve: %s", line)
    server: DrainingServer | None = None

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
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    server = DrainingServer(config, app.state.server, shutdown_delay)
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles SIGTERM (stop accepting, drain, shut down) and then re-raises it to the handler
        # that was installed before it: make that one a no-op, so a SIGTERM'd server exits 0
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    error = app.state.server.load_error
    if error is not None:
        raise error


def check_tls_files(certfile: str | None, keyfile: str | None) -> None:
    """The certificate chain and key load (one line naming the option if not, instead of uvicorn's traceback)."""
    if keyfile is not None and certfile is None:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile")
    if certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load them: {exc}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining first: the first SIGTERM (or Ctrl-C) marks ``state`` draining (``/ready``
    answers 503) and keeps serving ``delay`` seconds before uvicorn's own shutdown; a second one stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, delay: float):
        super().__init__(config)
        self.state, self.delay = state, delay

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self.delay <= 0:
            self.state.draining = True
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        log.warning("memfit serve: draining: /ready answers 503; stopping in %.1f s", self.delay)
        timer = threading.Timer(self.delay, super().handle_exit, (sig, frame))
        timer.daemon = True
        timer.start()
