"""A `memfit serve` app on a real loopback port for the tests of every layer that compares its answers over HTTP."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None, **client) -> None:
    """Until ``/ready`` answers 200 (``client``: httpx options, e.g. ``verify`` for TLS)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2, **client).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready after {timeout}s")


class ThreadServer:
    """uvicorn serving ``app`` in a background thread on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.torch_threads = torch.get_num_threads()  # the server takes all cores but one for its model

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        torch.set_num_threads(self.torch_threads)

    @property
    def runtime(self):
        return self.app.state.server.host


def post(url: str, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kwargs)
