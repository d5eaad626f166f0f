"""`memfit serve` over real HTTP on 127.0.0.1: parity with sentence-transformers, the CLI and the tokenizer,
concurrency, every limit and error, disconnects, SIGTERM drain and the memory budget.

Servers run uvicorn in a thread (tiny random models) or as a `memfit serve` subprocess (SIGTERM, peak RSS).
Every request loop is bounded in count and time.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import memfit
from memfit.jobs.classify import read_classifications
from memfit.cli import main
from memfit.serve import BatchingOptions, ServeOptions, create_app
from http_server import ThreadServer, free_port, post, wait_ready

WORDS = "the cat sat on the mat and the dog ran to the house in the city".split()


def torch_engines(model):
    """What the server hands its batcher: an engine per lane, here a PyTorch module (or a fake) on the CPU."""
    from memfit.engine.batches import TorchEngine

    return lambda head: TorchEngine(model, torch.device("cpu"), 0, head)


def text_of(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n_words))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    options = ServeOptions(
        model=tiny_model_dir, dtype="fp32", max_items=16, max_body_bytes=64 * 1024, max_queue_tokens=500_000
    )
    with ThreadServer(create_app(options)) as server:
        yield server


def assert_alive(url: str) -> None:
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/ready", timeout=10).status_code == 200
    assert post(url, "/embed", {"inputs": "still here"}).status_code == 200


# -- parity --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_openai_client_and_httpx_get_sentence_transformers_vectors(minilm_dir):
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    texts = [
        "A man is eating food.",
        "The new movie is awesome",
        "",
        "Un avion est en train de décoller.",
        "A cheetah is running behind its prey.",
    ]
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts)  # the model's pipeline normalizes
    with ThreadServer(create_app(ServeOptions(model=minilm_dir, dtype="fp32"))) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model_id = client.models.list().data[0].id
        as_floats = client.embeddings.create(input=texts, model=model_id, encoding_format="float")
        as_base64 = client.embeddings.create(input=texts, model=model_id)  # the client asks for base64
        tei = post(server.url, "/embed", {"inputs": texts}).json()
    for response in (as_floats, as_base64):
        assert [d.index for d in response.data] == list(range(len(texts)))
        np.testing.assert_allclose(np.array([d.embedding for d in response.data]), reference, atol=2e-6)
    np.testing.assert_allclose(np.array(tei), reference, atol=2e-6)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    assert as_floats.usage.prompt_tokens == sum(len(ids) for ids in tokenizer(texts)["input_ids"])


def test_long_input_equals_the_cli_vector_in_both_long_modes(tiny, tiny_model_dir, tmp_path):
    long_text = text_of(700, seed=1)  # ~700 tokens: 7+ windows of the tiny model's 128
    texts = [long_text, "short one", ""]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    for long in ("chunk", "truncate"):
        assert (
            main(
                [
                    "embed",
                    str(src),
                    "-o",
                    str(tmp_path / long),
                    "--model",
                    tiny_model_dir,
                    "--dtype",
                    "fp32",
                    "--long",
                    long,
                ]
            )
            == 0
        )
        cli = memfit.read(tmp_path / long).embeddings
        served = post(tiny.url, "/embed", {"inputs": texts, "normalize": False, "truncate": long == "truncate"})
        np.testing.assert_allclose(np.array(served.json()), cli, atol=1e-6)
    chunked = np.array(post(tiny.url, "/embed", {"inputs": [long_text], "normalize": False}).json())
    np.testing.assert_allclose(chunked, memfit.read(tmp_path / "chunk").embeddings[:1], atol=1e-6)  # server default


def test_embed_all_and_tokenize_cover_every_token(tiny, tiny_model_dir, tiny_encoder):
    from transformers import AutoTokenizer

    text = text_of(300, seed=2)
    rows = np.array(post(tiny.url, "/embed_all", {"inputs": [text]}).json()[0])
    reference = tiny_encoder.embed_tokens([text])[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tokenizer(text, return_offsets_mapping=True)  # no truncation: every token
    assert rows.shape == (len(expected["input_ids"]), 32)
    np.testing.assert_allclose(rows, reference.embeddings, atol=1e-6)
    tokens = post(tiny.url, "/tokenize", {"inputs": text}).json()[0]
    assert [t["id"] for t in tokens] == expected["input_ids"]
    assert [t["special"] for t in tokens] == [True] + [False] * (len(tokens) - 2) + [True]
    assert [(t["start"], t["stop"]) for t in tokens[1:-1]] == [tuple(o) for o in expected["offset_mapping"][1:-1]]
    assert all(t["text"] == text[t["start"] : t["stop"]] for t in tokens[1:-1])


def test_openai_shapes_dimensions_and_usage(tiny, tiny_encoder):
    texts = ["the cat", "the dog ran to the city"]
    body = post(tiny.url, "/v1/embeddings", {"input": texts, "dimensions": 8}).json()
    full = tiny_encoder.embed(texts)
    short = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(np.array([d["embedding"] for d in body["data"]]), short, atol=1e-6)
    raw = post(tiny.url, "/v1/embeddings", {"input": "the cat", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, full[0] / np.linalg.norm(full[0]), atol=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(len(tiny_encoder.tokenizer(t)["input_ids"]) for t in texts)
    models = httpx.get(tiny.url + "/v1/models").json()
    assert models["data"][0]["id"] == body["model"] == Path(tiny.runtime.model_name).name


def test_64_concurrent_requests_of_mixed_lengths_each_get_their_own_answer(tiny, tiny_encoder):
    requests = [
        [text_of(int(n), seed=100 * r + i) for i, n in enumerate(np.random.default_rng(r).integers(1, 400, 4))]
        for r in range(64)
    ]
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        with ThreadPoolExecutor(64) as pool:
            responses = list(pool.map(lambda texts: client.post(tiny.url + "/embed", json={"inputs": texts}), requests))
    assert [r.status_code for r in responses] == [200] * 64
    flat = [t for texts in requests for t in texts]
    expected = tiny_encoder.embed(flat, normalize=True).reshape(64, 4, -1)
    for response, vectors in zip(responses, expected):
        np.testing.assert_allclose(np.array(response.json()), vectors, atol=1e-5)


def test_zero_shot_over_http_equals_memfit_classify(tiny, tiny_model_dir, tiny_nli_dir, tmp_path):
    texts = ["the cat sat on the mat", "the city government said", text_of(400, seed=3), ""]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    labels = ["cats", "politics", "music"]
    for model, server_url in ((tiny_model_dir, tiny.url), (tiny_nli_dir, None)):
        for multi in (False, True):
            out = tmp_path / f"{Path(model).name}-{multi}"
            argv = [
                "classify",
                str(src),
                "--labels",
                ",".join(labels),
                "-o",
                str(out),
                "--model",
                model,
                "--dtype",
                "fp32",
            ] + (["--multi-label"] if multi else [])
            assert main(argv) == 0
            _, cli = read_classifications(out)
            body = {"inputs": texts, "labels": labels, "multi_label": multi}
            if server_url is None:
                with ThreadServer(create_app(ServeOptions(model=model, dtype="fp32"))) as nli:
                    served = post(nli.url, "/classify", body).json()
                    assert post(nli.url, "/embed", {"inputs": "x"}).status_code == 400  # a classifier only
            else:
                served = post(server_url, "/classify", body).json()
            for got, want in zip(served, cli):
                assert got["labels"] == want.labels
                np.testing.assert_allclose(got["scores"], want.scores, atol=1e-5)


# -- limits and errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/embed", {"inputs": ["x"] * 17}, 413, "inputs"),
        ("/v1/embeddings", {"input": ["x"] * 17}, 413, "input"),
        ("/classify", {"inputs": "x", "labels": [f"l{i}" for i in range(17)]}, 413, "labels"),
        ("/embed", {"inputs": 3}, 422, "inputs"),
        ("/embed", {"inputs": ["ok", 5]}, 422, "inputs[1]"),
        ("/embed", {"texts": ["x"]}, 422, "inputs"),
        ("/embed", {"inputs": []}, 422, "inputs"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 422, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "dimensions": 33}, 422, "dimensions"),
        ("/v1/embeddings", {"input": "x", "dimensions": 0}, 422, "dimensions"),
        ("/v1/embeddings", {"input": "x", "model": "gpt-4"}, 404, "model"),
        ("/classify", {"inputs": "x", "labels": ["a", "a"]}, 400, None),
        ("/classify", {"inputs": "x"}, 400, None),
        ("/embed", [1, 2], 422, "body"),
    ],
)
def test_each_bad_request_gets_its_status_and_names_the_field(tiny, path, body, status, field):
    response = post(tiny.url, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    if field is not None:
        assert field in message
        if path.startswith("/v1/"):
            assert error["param"] == field
    assert_alive(tiny.url)


def test_malformed_json_and_oversized_bodies(tiny):
    response = httpx.post(
        tiny.url + "/embed", content=b'{"inputs": ["a",', timeout=10, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]
    for content_type in ({}, {"content-type": "application/x-www-form-urlencoded"}):  # curl -d sends the latter
        response = httpx.post(tiny.url + "/embed", content=b'{"inputs": ["a"]}', timeout=10, headers=content_type)
        assert response.status_code == 415 and "header 'Content-Type'" in response.json()["error"]
    big = json.dumps({"inputs": ["word " * 20_000]}).encode()  # 100 kB > 64 KiB
    assert (
        httpx.post(
            tiny.url + "/embed", content=big, timeout=10, headers={"content-type": "application/json"}
        ).status_code
        == 413
    )
    # no Content-Length (chunked): the limit is counted as the body streams in
    chunks = (big[i : i + 8192] for i in range(0, len(big), 8192))
    response = httpx.post(tiny.url + "/embed", content=chunks, timeout=10, headers={"content-type": "application/json"})
    assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]
    assert_alive(tiny.url)


def read_http(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response from a raw socket: its status and body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer (got {data!r})"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ", 2)[1]), body


def test_a_stalled_body_gets_408_and_a_slow_one_in_time_is_answered(tiny_model_dir, tiny_encoder):
    with ThreadServer(create_app(ServeOptions(model=tiny_model_dir, dtype="fp32", body_timeout=1.5))) as server:
        address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        body = json.dumps({"inputs": ["the cat sat"]}).encode()
        head = (
            f"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(address, timeout=30) as sock:  # trickled, but whole within the limit
            sock.sendall(head)
            for i in range(0, len(body), 8):
                sock.sendall(body[i : i + 8])
                time.sleep(0.1)
            status, answer = read_http(sock)
        assert status == 200
        np.testing.assert_allclose(json.loads(answer), tiny_encoder.embed(["the cat sat"], normalize=True), atol=1e-6)
        with socket.create_connection(address, timeout=30) as sock:  # stalled half way: refused, not held for ever
            sock.sendall(head + body[:5])
            status, answer = read_http(sock)
        assert status == 408 and "--body-timeout" in json.loads(answer)["error"]
        assert _metric(server.url, 'memfit_rejected_requests_total{reason="body_timeout"}') == 1
        assert_alive(server.url)


def test_probes_answer_while_every_request_slot_is_held(tiny_model_dir):
    options = ServeOptions(model=tiny_model_dir, dtype="fp32", max_concurrent_requests=1, body_timeout=30)
    with ThreadServer(create_app(options)) as server:
        address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        head = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        with socket.create_connection(address, timeout=30) as sock:  # holds the one slot: its body never ends
            sock.sendall(head + b'{"inputs"')
            deadline = time.time() + 10
            while time.time() < deadline and post(server.url, "/embed", {"inputs": ["x"]}).status_code != 429:
                time.sleep(0.05)
            assert post(server.url, "/embed", {"inputs": ["the cat"]}).status_code == 429
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
            assert _metric(server.url, 'memfit_rejected_requests_total{reason="concurrency"}') >= 1
            assert _metric(server.url, "memfit_peak_rss_bytes") > 0


def test_empty_string_is_embedded_as_the_cli_does(tiny, tiny_encoder):
    vectors = np.array(post(tiny.url, "/embed", {"inputs": ["", "   "], "normalize": False}).json())
    np.testing.assert_allclose(vectors, tiny_encoder.embed([""] * 2), atol=1e-6)


def test_a_full_queue_answers_429_with_retry_after(tiny):
    admission = tiny.runtime.admission
    assert admission.try_acquire(admission.capacity - admission.held)  # hold the whole queue
    try:
        response = post(tiny.url, "/v1/embeddings", {"input": "the cat"})
        assert response.status_code == 429
        assert int(response.headers["retry-after"]) >= 1
    finally:
        admission.release(admission.capacity)
    assert_alive(tiny.url)
    capacity, admission.capacity = admission.capacity, 100
    try:
        too_big = post(tiny.url, "/embed", {"inputs": ["the cat " * 100]})  # more than the whole queue
    finally:
        admission.capacity = capacity
    assert too_big.status_code == 400 and "--max-queue-tokens" in too_big.json()["error"]


def test_a_disconnected_client_has_its_windows_dropped(tiny_model_dir):
    # an idle model waits up to max_wait for company: long enough to hang up first
    options = ServeOptions(model=tiny_model_dir, dtype="fp32", batching=BatchingOptions(max_wait=1.5))
    with ThreadServer(create_app(options)) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/embed", json={"inputs": ["the cat"] * 5}, timeout=0.3)
        deadline = time.time() + 10
        while time.time() < deadline and _metric(server.url, "memfit_dropped_windows_total") < 5:
            time.sleep(0.1)
        assert _metric(server.url, "memfit_dropped_windows_total") == 5
        assert _metric(server.url, "memfit_admitted_tokens") == 0
        assert_alive(server.url)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_health_is_live_at_once_and_ready_once_every_worker_has_run_its_first_batch(tiny_model_dir, monkeypatch):
    import memfit.serve.batcher as batcher_module

    release = threading.Event()
    warmed: list[str] = []  # the threads that ran a batch before the gate opened: the warm-up batches
    real_run_windows = batcher_module.run_windows

    def gated(engine, windows, budget, device):
        if not release.is_set():
            warmed.append(threading.current_thread().name)
            release.wait(30)
        return real_run_windows(engine, windows, budget, device)

    monkeypatch.setattr(batcher_module, "run_windows", gated)
    app = create_app(ServeOptions(model=tiny_model_dir, dtype="fp32", batching=BatchingOptions(workers=2)))
    server = ThreadServer(app)
    server.thread.start()
    try:
        deadline = time.time() + 60
        while len(warmed) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(warmed) == ["memfit-worker-0", "memfit-worker-1"]  # both warming up, neither done
        assert httpx.get(server.url + "/health").status_code == 200  # alive while it warms up
        not_ready = httpx.get(server.url + "/ready")
        assert not_ready.status_code == 503 and "loading" in not_ready.json()["error"]
        assert post(server.url, "/embed", {"inputs": "x"}).status_code == 503
        # the limits come with the model: a body that never arrives is refused at once, not read or waited for
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=20) as stalled:
            stalled.sendall(
                b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
            )
            answer = stalled.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 503") and "loading" in answer, answer
        release.set()
        wait_ready(server.url, timeout=60)
        assert sorted(warmed) == ["memfit-worker-0", "memfit-worker-1"]  # one warm-up batch each, no more
        metrics = httpx.get(server.url + "/metrics").text
        for name in (
            "memfit_queue_tokens",
            "memfit_batch_tokens_bucket",
            "memfit_request_seconds_bucket",
            "memfit_peak_rss_bytes",
            "memfit_memory_budget_bytes",
        ):
            assert name in metrics
    finally:
        release.set()
        server.__exit__()


# -- lifecycle and memory (subprocesses) ------------------------------------------------------------------


def start_cli_server(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc=proc)
    return proc, url


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_then_exits_0(tiny_model_dir, tiny_encoder):
    # the idle model waits 2 s for company, so the requests are still queued when SIGTERM arrives
    proc, url = start_cli_server("--model", tiny_model_dir, "--dtype", "fp32", "--max-wait-ms", "2000")
    try:
        texts = [[text_of(5 + 3 * i, seed=i)] for i in range(8)]  # one batch's worth in all
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(post, url, "/embed", {"inputs": t}) for t in texts]
            time.sleep(0.7)
            assert not any(f.done() for f in futures), [f.result().text for f in futures if f.done()]
            proc.send_signal(signal.SIGTERM)
            responses = [f.result(timeout=60) for f in futures]
        assert proc.wait(timeout=60) == 0
        assert [r.status_code for r in responses] == [200] * 8
        for response, t in zip(responses, texts):
            np.testing.assert_allclose(np.array(response.json()), tiny_encoder.embed(t, normalize=True), atol=1e-5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_peak_rss_stays_within_the_budget_under_a_bounded_load():
    from gensim.test.utils import datapath

    budget = 1 << 30
    proc, url = start_cli_server("--memory-budget", str(budget))
    try:
        docs = [line.strip() for line in open(datapath("lee_background.cor"), encoding="utf-8") if line.strip()]
        long_docs = [" ".join(docs[i : i + 8]) for i in range(0, 32, 8)]  # ~2,000 tokens each: chunked
        bodies = [{"inputs": [d[:300] for d in docs[4 * i : 4 * i + 4]]} for i in range(16)]
        bodies += [{"inputs": [d]} for d in long_docs] + [{"inputs": [d]} for d in docs[-4:]]
        with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=16)) as client:
            with ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(lambda b: client.post(url + "/embed", json=b).status_code, bodies))
                # the largest body the server takes, of the tokenizer's worst case (one-letter words)
                worst = {"inputs": "a " * (int(httpx.get(url + "/info").json()["max_body_bytes"]) // 2 - 100)}
                heavy = [("/tokenize", worst)] * 4 + [("/embed_all", {"inputs": [long_docs[0][:4000]]})]
                answers = list(pool.map(lambda b: client.post(url + b[0], json=b[1]), heavy))
                statuses += [r.status_code for r in answers]
            # Side by side the heavy bodies may be refused for now; the server still has to serve each of them
            # (the largest body it advertises), so once the load is over each is sent alone and must be answered.
            # A 429 right after the previous answer (its queue tokens are released once it is sent) is retried.
            for route, body in (heavy[0], heavy[-1]):  # the worst /tokenize body, the /embed_all one
                for _ in range(20):
                    response = client.post(url + route, json=body)
                    if response.status_code != 429:
                        break
                    time.sleep(0.5)
                assert response.status_code == 200, (route, response.status_code, response.text[:500])
        # answered, or refused for now: never over the budget
        assert set(statuses) <= {200, 429}, [(r.status_code, r.text[:300]) for r in answers if r.status_code != 200]
        assert statuses[: len(bodies)] == [200] * len(bodies)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        peak = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) * 1024
        print(f"server peak RSS {peak / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
        assert peak <= budget, f"peak RSS {peak / 2**20:.0f} MiB over the {budget / 2**20:.0f} MiB budget"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["nli", "cross-encoder"])
def test_a_stride_no_request_can_use_stops_the_server_at_start(tiny_nli_dir, tiny_cross_encoder_dirs, model):
    """``--stride`` is the server's for every request: for a classifier or a cross-encoder it was never checked at
    start, and every /classify or /rerank of long texts then answered 400 for the server's own setting."""
    from memfit.serve.host import ServerHost

    path = tiny_nli_dir if model == "nli" else tiny_cross_encoder_dirs["one_logit"]
    with pytest.raises(memfit.ConfigError, match="stride must be between 0 and"):
        ServerHost(ServeOptions(model=path, dtype="fp32", stride=1000))


def test_memfit_serve_refuses_a_budget_the_model_does_not_fit(tiny_model_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit",
            "serve",
            "--model",
            tiny_model_dir,
            "--port",
            str(free_port()),
            "--memory-budget",
            "50MB",
        ],
        capture_output=True,
        timeout=120,
        env={**os.environ},
    )
    assert result.returncode == 4
    assert "memory budget" in result.stderr.decode()


# -- the batcher on its own ---------------------------------------------------------------------------------


class ShapeRecorder(torch.nn.Module):
    """A stand-in model: records each batch's (batch, padded length) and returns nothing."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def forward(self, input_ids, attention_mask):
        self.shapes.append(tuple(input_ids.shape))


def test_batcher_keeps_every_batch_within_the_token_budget_and_answers_each_ticket_in_order():
    from memfit.data.chunking import Window
    from memfit.engine.batches import AdaptiveBudget
    from memfit.memory.planner import BatchBudget
    from memfit.serve.batcher import Batcher, Lane

    model = ShapeRecorder()
    budget = AdaptiveBudget(BatchBudget(max_batch_tokens=256))
    batcher = Batcher(torch_engines(model), torch.device("cpu"), budget, BatchingOptions(max_wait=0.005, lookahead=64))
    lane = Lane("ids", lambda output, mask, windows: [int(w.input_ids[1]) for w in windows])  # a window's tag
    rng = np.random.default_rng(0)
    batcher.start()
    try:
        tickets, expected = [], []
        for t in range(40):
            lengths = rng.integers(3, 120, rng.integers(1, 6))
            tags = [1000 * t + i for i in range(len(lengths))]
            windows = [
                Window(
                    item=i,
                    index=0,
                    input_ids=np.array([1, tag] + [5] * (n - 2)),
                    token_type_ids=None,
                    own_start=0,
                    own_end=int(n),
                )
                for i, (tag, n) in enumerate(zip(tags, lengths))
            ]
            tickets.append(batcher.submit(lane, windows))
            expected.append(tags)
        results = [ticket.future.result(timeout=60) for ticket in tickets]
    finally:
        batcher.stop()
    assert results == expected
    assert all(b * length <= 256 for b, length in model.shapes)  # padded cost within the budget
    assert sum(b for b, _ in model.shapes) == sum(len(tags) for tags in expected)  # each window ran once


class OverlapRecorder(torch.nn.Module):
    """A stand-in model whose forward takes a while (sleeping, so without the GIL): records each batch's
    shape and the padded tokens of the batches running at the same moment."""

    def __init__(self, seconds: float = 0.02):
        super().__init__()
        self.seconds = seconds
        self.lock = threading.Lock()
        self.shapes: list[tuple[int, int]] = []
        self.running_tokens = self.running_batches = 0
        self.peak_tokens = self.peak_batches = 0

    def forward(self, input_ids, attention_mask):
        batch, length = input_ids.shape
        with self.lock:
            self.shapes.append((batch, length))
            self.running_tokens += batch * length
            self.running_batches += 1
            self.peak_tokens = max(self.peak_tokens, self.running_tokens)
            self.peak_batches = max(self.peak_batches, self.running_batches)
        time.sleep(self.seconds)
        with self.lock:
            self.running_tokens -= batch * length
            self.running_batches -= 1


def _tagged_windows(lengths, first_tag: int):
    from memfit.data.chunking import Window

    return [
        Window(
            item=i,
            index=0,
            input_ids=np.array([1, first_tag + i] + [5] * (int(n) - 2)),
            token_type_ids=None,
            own_start=0,
            own_end=int(n),
        )
        for i, n in enumerate(lengths)
    ]


def test_workers_run_batches_side_by_side_within_the_token_budget_together():
    from memfit.engine.batches import AdaptiveBudget
    from memfit.memory.planner import BatchBudget
    from memfit.serve.batcher import Batcher, Lane

    model = OverlapRecorder()
    budget = AdaptiveBudget(BatchBudget(max_batch_tokens=256))
    batcher = Batcher(torch_engines(model), torch.device("cpu"), budget, BatchingOptions(max_wait=0.005, workers=2))
    lane = Lane("ids", lambda output, mask, windows: [int(w.input_ids[1]) for w in windows])
    rng = np.random.default_rng(1)
    batcher.start()
    try:
        tickets, expected = [], []
        for t in range(40):
            lengths = rng.integers(3, 60, rng.integers(1, 6))
            tickets.append(batcher.submit(lane, _tagged_windows(lengths, 1000 * t)))
            expected.append([1000 * t + i for i in range(len(lengths))])
        results = [ticket.future.result(timeout=60) for ticket in tickets]
    finally:
        batcher.stop()
    assert results == expected
    assert model.peak_batches == 2  # the two workers did run at once
    assert all(b * length <= 128 for b, length in model.shapes)  # each batch within its half of the budget
    assert model.peak_tokens <= 256  # and the batches running together within the whole budget
    assert sum(b for b, _ in model.shapes) == sum(len(tags) for tags in expected)


def test_idle_workers_share_a_partial_batch():
    from memfit.engine.batches import AdaptiveBudget
    from memfit.memory.planner import BatchBudget
    from memfit.serve.batcher import Batcher, Lane

    model = OverlapRecorder(seconds=0.2)
    batcher = Batcher(
        torch_engines(model),
        torch.device("cpu"),
        AdaptiveBudget(BatchBudget(max_batch_tokens=256)),
        BatchingOptions(max_wait=0.001, workers=2),
    )
    lane = Lane("ids", lambda output, mask, windows: [int(w.input_ids[1]) for w in windows])
    batcher.start()
    try:
        ticket = batcher.submit(lane, _tagged_windows([8] * 8, 0))  # 64 padded tokens: half a worker's share
        assert ticket.future.result(timeout=60) == list(range(8))
    finally:
        batcher.stop()
    assert sorted(model.shapes) == [(4, 8), (4, 8)] and model.peak_batches == 2


def test_an_overdue_request_rides_whole_in_one_batch_topped_up_with_windows_that_pad_no_wider():
    from memfit.memory.planner import BatchBudget
    from memfit.serve.batcher import whole_request_run

    budget = BatchBudget(max_batch_tokens=8 * 64)  # eight windows of 64 padded tokens
    # the overdue request: windows 0, 3, 5 (widest 60 -> 64 padded); the others are other requests'
    lengths = [10, 30, 62, 60, 100, 33, 64, 57, 20, 61]
    chosen = whole_request_run(lengths, [0, 3, 5], budget)
    assert chosen[:3] == [0, 3, 5]
    # topped up to eight with the longest of the rest that pad to <= 64 (100 would widen the batch)
    assert sorted(chosen[3:]) == sorted([2, 6, 9, 7, 1]) and 4 not in chosen
    assert len(chosen) * 64 <= budget.max_batch_tokens
    # a request that does not fit one batch (4 x 200 padded > 256) falls back to the fullest run around
    # its first window: its three short windows now, the long one in a batch of its own later
    assert sorted(whole_request_run([8, 8, 8, 200], [0, 1, 2, 3], BatchBudget(max_batch_tokens=256))) == [0, 1, 2]


def test_each_batch_is_chosen_from_the_lookahead_oldest_windows():
    from memfit.engine.batches import AdaptiveBudget
    from memfit.memory.planner import BatchBudget
    from memfit.serve.batcher import Batcher, Lane

    batches: list[list[int]] = []

    def tags(output, mask, windows):
        batches.append([int(w.input_ids[1]) for w in windows])
        return batches[-1]

    # every window fits one batch: only the look-ahead keeps a batch from taking the short ones first
    batcher = Batcher(
        torch_engines(OverlapRecorder(seconds=0.01)),
        torch.device("cpu"),
        AdaptiveBudget(BatchBudget(max_batch_tokens=100_000)),
        BatchingOptions(max_wait=0.001, lookahead=4, workers=1),
    )
    batcher.start()
    try:
        lengths = [96, 8, 96, 8, 96, 8, 96, 8, 96, 8, 96, 8]
        assert batcher.submit(Lane("ids", tags), _tagged_windows(lengths, 0)).future.result(timeout=60) == list(
            range(12)
        )
    finally:
        batcher.stop()
    waiting = list(range(12))  # in arrival order
    for batch in batches:
        assert set(batch) <= set(waiting[:4])
        waiting = [tag for tag in waiting if tag not in batch]
    assert not waiting


def test_model_workers_default_to_one_per_core_as_far_as_the_budget_holds_a_window_each():
    from memfit.errors import ConfigError
    from memfit.serve.options import model_threads, model_workers

    cores = len(os.sched_getaffinity(0))
    assert model_threads(None) == 1
    assert model_workers(None, True, 1, batch_tokens=4096, window_tokens=256) == min(cores, 16)
    assert model_workers(None, True, 1, batch_tokens=300, window_tokens=256) == 1  # one window fills the budget
    assert model_workers(None, False, 1, batch_tokens=4096, window_tokens=256) == 1  # a GPU runs one batch
    assert model_workers(3, True, 1, batch_tokens=4096, window_tokens=256) == 3
    with pytest.raises(ConfigError, match="--model-workers"):
        model_workers(0, True, 1, 4096, 256)
    with pytest.raises(ConfigError, match="holds 2 windows"):  # 3 windows of 256 at once would pass the plan
        model_workers(3, True, 1, 600, 256)


def test_float_json_holds_exactly_the_float32_of_the_base64_answer(tiny):
    texts = ["the cat sat", "a dog ran to the city", ""]
    as_floats = post(tiny.url, "/v1/embeddings", {"input": texts, "encoding_format": "float"}).json()
    as_base64 = post(tiny.url, "/v1/embeddings", {"input": texts, "encoding_format": "base64"}).json()
    floats = np.array([d["embedding"] for d in as_floats["data"]], dtype=np.float64)
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in as_base64["data"]])
    assert np.array_equal(floats.astype(np.float32), decoded)  # the text reads back to the very float32


def test_best_run_takes_the_fullest_run_of_neighbouring_lengths_and_keeps_an_overdue_window():
    from memfit.memory.planner import BatchBudget
    from memfit.serve.batcher import best_run

    budget = BatchBudget(max_batch_tokens=64)  # lengths pad to multiples of 8
    lengths = [30, 5, 6, 7, 8, 9, 20, 3]
    # by hand: width 8 holds 8 windows: 3,5,6,7,8 (29 tokens); width 16 holds 4: 6,7,8,9 (30);
    # width 24 holds 2: 9,20 (29); width 32 holds 2: 20,30 (50 tokens: the most)
    assert sorted(best_run(lengths, budget)) == [0, 6]
    # the oldest window (length 3) overdue: the best run holding it is 3,5,6,7,8 (width 8)
    assert sorted(best_run(lengths, budget, anchor=7)) == [1, 2, 3, 4, 7]
    assert best_run([500, 4], budget, anchor=0) == [0]  # over the budget alone: a batch of its own


def test_model_workers_is_how_many_batches_serve_runs_at_once_and_workers_its_unlisted_old_name(capsys):
    from memfit.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--model-workers", "3"]).model_workers == 3
    assert parser.parse_args(["serve", "--workers", "2"]).model_workers == 2  # one release of the old name
    assert parser.parse_args(["serve"]).model_workers is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--model-workers N" in shown and "--workers" not in shown


def test_auto_bf16_that_fails_the_guard_at_start_serves_fp32_instead_of_refusing(
    tiny_model_dir, monkeypatch, openvino_bf16
):
    """``memfit serve`` under dtype=auto did what ``memfit embed`` no longer does: a bf16 graph that failed the quality
    guard refused the start (exit 5) where fp32 on the same backend runs. It now serves fp32, as embed runs it; an
    explicit ``--dtype bf16`` still refuses."""
    from memfit.engine import models, precision

    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(precision, "DEFAULT_MIN_COSINE", {**precision.DEFAULT_MIN_COSINE, "bf16": 1.5})  # unmeetable
    texts = [text_of(12, seed=3), "short one", text_of(40, seed=4)]
    with ThreadServer(create_app(ServeOptions(model=tiny_model_dir))) as server:
        info = httpx.get(server.url + "/info").json()
        served = np.array(post(server.url, "/embed", {"inputs": texts, "normalize": False}).json())
    assert (info["model_dtype"], info["backend"]) == ("fp32", "openvino")
    expected = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino").embed(texts)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    from memfit.serve.host import ServerHost

    with pytest.raises(memfit.QualityError):
        ServerHost(ServeOptions(model=tiny_model_dir, dtype="bf16"))
