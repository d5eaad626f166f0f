"""`memfit serve` on a network: API keys (every route of the app, listed from the app itself), the official
`openai` client, TEI-style httpx and `huggingface_hub`'s `InferenceClient` with and without a key, TLS with a
certificate made here, the keys' sources on the command line, and draining after SIGTERM.

Servers reuse test_serve's harness (uvicorn in a thread, or a `memfit serve` subprocess); loopback only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import ssl
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from starlette.routing import Mount, Route

from memfit.serve import ServeOptions, create_app
from memfit.serve.auth import startup_lines
from http_server import ThreadServer, free_port, post, wait_ready

KEYS = ("sk-memfit-first-key", "second-key")
PROBES = {"/health", "/ready"}
DOCS_AND_METRICS = {"/metrics", "/docs", "/openapi.json", "/docs/assets/swagger-ui.css"}


def keyed(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def locked(tiny_model_dir):
    """A server that needs one of :data:`KEYS`."""
    with ThreadServer(create_app(ServeOptions(model=tiny_model_dir, dtype="fp32", api_keys=KEYS))) as server:
        yield server


def app_requests(routes) -> list[tuple[str, str]]:
    """(method, path) of every route in ``routes`` (the app's own list; a mount: one file under it). FastAPI
    0.16x keeps an included router as one entry holding the router (``original_router``; no prefixes here)."""
    requests = []
    for route in routes:
        if hasattr(route, "original_router"):
            requests += app_requests(route.original_router.routes)
        elif isinstance(route, Route):  # FastAPI's APIRoute too
            requests += [(method, route.path) for method in sorted(route.methods) if method != "HEAD"]
        elif isinstance(route, Mount):
            requests.append(("GET", route.path + "/swagger-ui.css"))
        else:
            raise AssertionError(f"a route this test does not know how to call: {route!r}")
    return requests


def assert_refused(response: httpx.Response, why: str) -> None:
    assert response.status_code == 401, (response.request.url, response.text)
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]  # OpenAI's shape, on every route
    assert error["type"] == "authentication_error" and error["code"] == 401 and error["param"] == "Authorization"
    assert why in error["message"]


def test_every_route_but_the_probes_answers_401_without_a_valid_key(locked):
    requests = app_requests(locked.app.routes)
    paths = {path for _, path in requests}
    assert {"/v1/embeddings", "/embed", "/rerank", "/v1/rerank", "/classify", "/info"} | DOCS_AND_METRICS <= paths
    assert PROBES <= paths
    for method, path in requests:
        if path in PROBES:
            assert httpx.request(method, locked.url + path, timeout=10).status_code == 200, path
            continue
        body = {"content": b"{}", "headers": {"content-type": "application/json"}} if method == "POST" else {}
        assert_refused(httpx.request(method, locked.url + path, timeout=10, **body), "no API key")
        for header, why in (
            ({"Authorization": "Bearer not-a-key"}, "invalid API key"),
            ({"Authorization": f"Bearer {KEYS[0]}x"}, "invalid API key"),
            ({"Authorization": f"Basic {KEYS[0]}"}, "expected 'Bearer <key>'"),
        ):
            kwargs = {**body, "headers": {**body.get("headers", {}), **header}}
            assert_refused(httpx.request(method, locked.url + path, timeout=10, **kwargs), why)
        for key in KEYS:  # each key opens every route (a POST of {} is then refused for its fields, not its key)
            kwargs = {**body, "headers": {**body.get("headers", {}), **keyed(key)}}
            assert httpx.request(method, locked.url + path, timeout=10, **kwargs).status_code in (200, 400, 422)
    metrics = httpx.get(locked.url + "/metrics", headers=keyed(KEYS[1]), timeout=10).text
    assert 'memfit_rejected_requests_total{reason="unauthorized"}' in metrics


def test_public_metrics_and_docs_opens_those_and_nothing_else(tiny_model_dir):
    options = ServeOptions(model=tiny_model_dir, dtype="fp32", api_keys=KEYS, public_metrics_and_docs=True)
    with ThreadServer(create_app(options)) as server:
        for path in DOCS_AND_METRICS:
            assert httpx.get(server.url + path, timeout=10).status_code == 200, path
        assert_refused(post(server.url, "/embed", {"inputs": "a cat"}), "no API key")
        assert_refused(httpx.get(server.url + "/info", timeout=10), "no API key")


def test_the_official_openai_client_works_with_a_key_and_fails_clearly_without(locked, tiny_encoder):
    import openai

    texts = ["the cat sat on the mat", "a dog"]
    client = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEYS[1], max_retries=0)
    response = client.embeddings.create(input=texts, model=client.models.list().data[0].id, encoding_format="float")
    np.testing.assert_allclose(
        np.array([d.embedding for d in response.data]), tiny_encoder.embed(texts, normalize=True), atol=1e-6
    )
    stranger = openai.OpenAI(base_url=locked.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        stranger.embeddings.create(input=texts, model="all-MiniLM-L6-v2")


def test_tei_routes_over_httpx_and_huggingface_hub_with_and_without_a_key(locked, tiny_encoder):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    texts = ["the cat sat on the mat", "hello world", ""]
    expected = tiny_encoder.embed(texts, normalize=True)
    tei = post(locked.url, "/embed", {"inputs": texts}, headers=keyed(KEYS[0]))
    np.testing.assert_allclose(np.array(tei.json()), expected, atol=1e-6)
    assert_refused(post(locked.url, "/embed", {"inputs": texts}), "no API key")

    hub = InferenceClient(model=locked.url + "/embed", token=KEYS[0])
    np.testing.assert_allclose(hub.feature_extraction(texts[0]), expected[:1], atol=1e-6)
    raw = hub.feature_extraction(texts[1], normalize=False)
    np.testing.assert_allclose(raw, tiny_encoder.embed(texts[1:2]), atol=1e-6)
    with pytest.raises(HfHubHTTPError) as refused:
        InferenceClient(model=locked.url + "/embed", token="hf_wrong").feature_extraction(texts[0])
    assert refused.value.response.status_code == 401


@pytest.mark.parametrize(
    ("host", "keys", "info", "warning"),
    [
        ("127.0.0.1", (), False, False),
        ("::1", (), False, False),
        ("localhost", (), False, False),
        ("0.0.0.0", (), False, True),
        ("10.1.2.3", (), False, True),
        ("memfit.example.org", (), False, True),
        ("0.0.0.0", ("k",), True, False),
        ("127.0.0.1", ("k", "l"), True, False),
    ],
)
def test_startup_says_auth_is_on_and_warns_of_a_network_address_without_a_key(host, keys, info, warning):
    on, warned = startup_lines(host, keys, public_metrics_and_docs=False)
    assert (on is not None, warned is not None) == (info, warning)
    if warned:
        assert host in warned and "--api-key" in warned


# -- the command line: keys from every source, TLS, draining (subprocesses) ------------------------------


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made with `cryptography` (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "memfit test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def cli_server(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    return proc, port


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM, the exit status checked; the server's stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.stderr.read().decode()


@pytest.mark.slow
def test_https_with_keys_from_the_flag_the_variable_and_the_file(tiny_model_dir, tiny_encoder, tmp_path):
    cert, key = self_signed(tmp_path)
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# one key per line\nfile-key\n\n")
    env = {**os.environ, "MEMFIT_API_KEY": "env-key-1, env-key-2"}
    proc, port = cli_server(
        "--model", tiny_model_dir, "--dtype", "fp32", "--api-key", "flag-key", "--api-key-file", str(key_file),
        "--ssl-certfile", cert, "--ssl-keyfile", key, env=env,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    trusted = ssl.create_default_context(cafile=cert)
    try:
        wait_ready(url, proc=proc, verify=trusted)
        for source in ("flag-key", "env-key-1", "env-key-2", "file-key"):
            response = httpx.post(url + "/embed", json={"inputs": ["a cat"]}, headers=keyed(source), verify=trusted)
            assert response.status_code == 200, (source, response.text)
            np.testing.assert_allclose(
                np.array(response.json()), tiny_encoder.embed(["a cat"], normalize=True), atol=1e-6
            )
        assert_refused(httpx.post(url + "/embed", json={"inputs": ["a cat"]}, verify=trusted), "no API key")
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", timeout=10)  # the system's trust store does not know this certificate
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)  # plain HTTP to a TLS port
    finally:
        log = stop(proc)
    assert "API key authentication is on (4 keys)" in log
    assert all(k not in log for k in ("flag-key", "env-key", "file-key"))  # keys never reach the log
    assert "Traceback" not in log


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "missing.pem"], "--ssl-certfile missing.pem"),
        (["--api-key-file", "missing.txt"], "--api-key-file missing.txt: cannot read it"),
        (["--api-key", "two words"], "printable ASCII without spaces"),
    ],
)
def test_unusable_keys_or_certificates_stop_the_server_with_one_line(tiny_model_dir, tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, "-m", "memfit", "serve", "--model", tiny_model_dir, "--port", str(free_port()), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "99999"], "--port must be between 0 and 65535, got 99999"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be a whole number of at least 1, got 0"),
        (["--max-items", "-1"], "--max-items must be a whole number of at least 1, got -1"),
        (["--max-concurrent-requests", "0"], "--max-concurrent-requests must be a whole number of at least 1"),
        (["--api-key-file", "latin1.txt"], "--api-key-file latin1.txt: not UTF-8 text (byte 3)"),
    ],
)
def test_limits_a_port_or_a_key_file_that_cannot_work_are_one_line_before_the_model_loads(
    tiny_model_dir, tmp_path, monkeypatch, capsys, args, message
):
    """Each was a traceback (OverflowError from the socket, ZeroDivisionError while the limits were derived,
    UnicodeDecodeError) or a server that answered every request 413."""
    from memfit.cli import main

    (tmp_path / "latin1.txt").write_bytes(b"key\xe9\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("memfit.serve.create_app", lambda *a, **k: pytest.fail("the model should not load"))
    assert main(["serve", "--model", tiny_model_dir, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_key_file_saved_with_a_byte_order_mark_and_crlf_gives_its_keys(tmp_path):
    """Windows editors write a BOM and CRLF: the BOM was read as part of the first key, which was then refused as
    not printable ASCII."""
    from memfit.serve.auth import check_api_keys, read_api_key_file

    path = tmp_path / "keys.txt"
    path.write_bytes(b"\xef\xbb\xbfsecret-key\r\n# a comment\r\nother-key\r\n")
    assert check_api_keys(read_api_key_file(path)) == ("secret-key", "other-key")


@pytest.mark.slow
def test_sigterm_turns_ready_to_503_and_serves_through_the_shutdown_delay(tiny_model_dir, tiny_encoder):
    proc, port = cli_server("--model", tiny_model_dir, "--dtype", "fp32", "--shutdown-delay", "5")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc=proc)
        proc.send_signal(signal.SIGTERM)
        sent = time.time()
        deadline = sent + 4
        while httpx.get(url + "/ready", timeout=5).status_code == 200 and time.time() < deadline:
            time.sleep(0.05)
        draining = httpx.get(url + "/ready", timeout=5)
        assert draining.status_code == 503 and "draining" in draining.json()["error"]
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # alive: no restart wanted
        answer = post(url, "/embed", {"inputs": ["a cat"]})  # still served while the load balancer catches up
        np.testing.assert_allclose(np.array(answer.json()), tiny_encoder.embed(["a cat"], normalize=True), atol=1e-6)
        assert proc.wait(timeout=60) == 0
        assert time.time() - sent >= 5  # it kept serving for the whole delay
    finally:
        log = stop(proc)
    assert "draining" in log and "Traceback" not in log
