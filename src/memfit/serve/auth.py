"""API keys for ``memfit serve``: Bearer tokens, as OpenAI's clients (and TEI's, and Cohere's) send them.

Every route needs ``Authorization: Bearer <key>`` once keys are set, except the probes ``/health`` and
``/ready``: a load balancer or kubelet must reach them without a secret, and they tell nothing but whether the
process is up and ready. ``/metrics`` and the API document (``/docs``, its assets, ``/openapi.json``) need a key
too unless ``public_metrics_and_docs`` opens them (for a Prometheus scraper that sends no token).

A key is compared with every configured key in constant time (:func:`hmac.compare_digest`, each one, no early
exit), so the answer's timing does not tell how much of a guess was right. A refusal is 401 with OpenAI's error
body on every route (the shape OpenAI's clients turn into ``AuthenticationError``) and ``WWW-Authenticate:
Bearer`` (RFC 6750).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from pathlib import Path
from typing import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from memfit.errors import ConfigError

PROBES = frozenset({"/health", "/ready"})
"""Paths answered without a key: the liveness and readiness probes."""

DOCS_AND_METRICS = ("/metrics", "/docs", "/openapi.json")
"""Paths (and, for ``/docs``, everything under it) that ``public_metrics_and_docs`` opens."""


def read_api_key_file(path: str | Path) -> list[str]:
    """The keys in ``path``: one per line; blank lines and lines starting with ``#`` are skipped. A byte-order mark
    (Windows editors write one) is not part of the first key."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except OSError as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--api-key-file {path}: not UTF-8 text (byte {exc.start}); keys are one per line") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"--api-key-file {path}: holds no key (one per line)")
    return keys


def check_api_keys(keys: Iterable[str]) -> tuple[str, ...]:
    """``keys`` without duplicates, each a usable Bearer token (no whitespace, printable ASCII)."""
    checked = tuple(dict.fromkeys(keys))
    for key in checked:
        if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
            raise ConfigError(
                "an API key must be printable ASCII without spaces (it travels in an HTTP header); "
                f"got one of {len(key)} characters that is not"
            )
    return checked


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def startup_lines(host: str, keys: tuple[str, ...], public_metrics_and_docs: bool) -> tuple[str | None, str | None]:
    """What ``memfit serve`` says at start-up about access: (an info line when keys are on, a warning when a
    non-loopback address is served without one)."""
    if keys:
        opened = "open without a key" if public_metrics_and_docs else "need a key"
        return (
            f"API key authentication is on ({len(keys)} key{'s' if len(keys) > 1 else ''}): every route but "
            f"/health and /ready needs 'Authorization: Bearer <key>'; /metrics and /docs {opened}",
            None,
        )
    if not is_loopback(host):
        return None, (
            f"listening on {host} without an API key: anyone who can reach this address can use the server "
            "(set --api-key, MEMFIT_API_KEY or --api-key-file)"
        )
    return None, None


class ApiKeyGuard:
    """ASGI middleware: 401 for an HTTP request without one of ``keys`` as its Bearer token (before its body
    is read); ``on_refused`` is told of each refusal (the metrics count them)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        public_metrics_and_docs: bool = False,
        on_refused: Callable[[], None] = lambda: None,
    ):
        self.app = app
        self.keys = [key.encode("ascii") for key in keys]
        self.public_metrics_and_docs = public_metrics_and_docs
        self.on_refused = on_refused

    def open_path(self, path: str) -> bool:
        if path in PROBES:
            return True
        return self.public_metrics_and_docs and (path in DOCS_AND_METRICS or path.startswith("/docs/"))

    def accepts(self, token: bytes) -> bool:
        """Whether ``token`` is a key: compared with every key, each in constant time."""
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(token, key)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or self.open_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers", [])).get(b"authorization")
        scheme, _, token = (header or b"").strip().partition(b" ")
        if header is None:
            message = "no API key: send the header 'Authorization: Bearer <key>'"
        elif scheme.lower() != b"bearer" or not token.strip():
            message = "header 'Authorization': expected 'Bearer <key>'"
        elif not self.accepts(token.strip()):
            message = "header 'Authorization': invalid API key"
        else:
            await self.app(scope, receive, send)
            return
        self.on_refused()
        await _unauthorized(message, send)


async def _unauthorized(message: str, send: Send) -> None:
    """401 in OpenAI's error shape (what its clients read as an authentication error), on every route."""
    body = json.dumps(
        {"error": {"message": message, "type": "authentication_error", "param": "Authorization", "code": 401}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
