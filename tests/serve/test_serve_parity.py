"""One set of jobs: the same inputs through `memfit serve` (HTTP) and through the `memfit` command (a
subprocess) give the same answers, route by route and mode by mode (embed; classify in embedding, NLI and
supervised mode; rerank), and the same refusals, word for word."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import memfit
from memfit.jobs.classify import read_classifications
from memfit.serve import ServeOptions, create_app
from http_server import ThreadServer, post

pytestmark = pytest.mark.slow

WORDS = "the cat sat on the mat and the dog ran to the house in the city with music".split()
LONG = " ".join(np.random.default_rng(3).choice(WORDS, 260))  # several windows of the tiny models' 128
TEXTS = ["a cat on the mat", "music in the city", "", "the dog ran to the house", LONG]
QUERY = "where is the cat"


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tiny_nli_dir, tiny_cross_encoder_dirs):
    models = {"embedding": tiny_model_dir, "nli": tiny_nli_dir, "cross_encoder": tiny_cross_encoder_dirs["two_class"]}
    running = {name: ThreadServer(create_app(ServeOptions(model=path, dtype="fp32"))) for name, path in models.items()}
    for server in running.values():
        server.__enter__()
    yield {name: (server.url, models[name]) for name, server in running.items()}
    for server in running.values():
        server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("parity") / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memfit", *argv, "--dtype", "fp32"], capture_output=True, text=True, timeout=300
    )


def cli_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr.strip().splitlines()[-1].removeprefix("memfit: error: ")


def test_embed(servers, texts_file, tmp_path):
    url, model = servers["embedding"]
    done = cli("embed", str(texts_file), "--model", model, "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    served = post(url, "/embed", {"inputs": TEXTS, "normalize": False})
    np.testing.assert_allclose(np.array(served.json()), memfit.read(tmp_path / "out").embeddings, atol=1e-6)


@pytest.mark.parametrize(
    "server, labels",
    [
        ("embedding", ["cats", "dogs", "music"]),
        ("nli", ["cats", "dogs", "music"]),
        ("cross_encoder", None),  # supervised: the model's own labels
    ],
)
def test_classify_in_each_mode(servers, texts_file, tmp_path, server, labels):
    url, model = servers[server]
    label_args = [] if labels is None else ["--labels", ",".join(labels)]
    done = cli("classify", str(texts_file), "--model", model, *label_args, "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    _, want = read_classifications(tmp_path / "out")
    served = post(url, "/classify", {"inputs": TEXTS, "labels": labels})
    assert served.status_code == 200, served.text
    for got, expected in zip(served.json(), want, strict=True):
        assert got["labels"] == expected.labels
        np.testing.assert_allclose(got["scores"], expected.scores, atol=1e-5)


def test_rerank(servers, texts_file, tmp_path):
    url, model = servers["cross_encoder"]
    done = cli("rerank", str(texts_file), "--query", QUERY, "--model", model, "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    want = pq.read_table(tmp_path / "out" / "part-00000.parquet").column("score").to_numpy()
    hits = post(url, "/rerank", {"query": QUERY, "texts": TEXTS}).json()
    np.testing.assert_allclose([h["score"] for h in sorted(hits, key=lambda h: h["index"])], want, atol=1e-5)
    assert [h["index"] for h in hits] == sorted(range(len(TEXTS)), key=lambda i: -want[i])


@pytest.mark.parametrize(
    "server, cli_args, path, body",
    [
        ("embedding", ["classify", "--labels", "cats"], "/classify", {"labels": ["cats"]}),  # one label, embedding mode
        ("nli", ["classify", "--labels", "cats,cats"], "/classify", {"labels": ["cats", "cats"]}),
        ("cross_encoder", ["classify", "--labels", "nope"], "/classify", {"labels": ["nope"]}),
        ("embedding", ["rerank", "--query", QUERY], "/rerank", {"query": QUERY}),  # not a cross-encoder
        ("cross_encoder", ["rerank", "--query", " ".join(["cat"] * 80)], "/rerank", {"query": " ".join(["cat"] * 80)}),
    ],
)
def test_the_same_refusal_word_for_word(servers, texts_file, tmp_path, server, cli_args, path, body):
    url, model = servers[server]
    job, *options = cli_args
    message = cli_error(cli(job, str(texts_file), *options, "--model", model, "-o", str(tmp_path / "out")))
    field = "texts" if path == "/rerank" else "inputs"
    served = post(url, path, {field: TEXTS, **body})
    assert served.status_code == 400, served.text
    assert served.json()["error"] == message


def test_openai_embeddings(servers, texts_file, tmp_path):
    """/v1/embeddings normalizes as OpenAI's vectors are (memfit serve's default): `memfit embed --normalize`."""
    url, model = servers["embedding"]
    done = cli("embed", str(texts_file), "--model", model, "--normalize", "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    served = post(url, "/v1/embeddings", {"input": TEXTS})
    assert served.status_code == 200, served.text
    got = np.array([item["embedding"] for item in sorted(served.json()["data"], key=lambda item: item["index"])])
    np.testing.assert_allclose(got, memfit.read(tmp_path / "out").embeddings, atol=1e-6)


def test_embed_all_token_vectors(servers, texts_file, tmp_path):
    """/embed_all: one vector per token, special tokens included, as `memfit embed --tokens` writes them (the long
    text's several windows merged into one sequence in both)."""
    url, model = servers["embedding"]
    done = cli("embed", str(texts_file), "--model", model, "--tokens", "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    written = memfit.read(tmp_path / "out")
    served = post(url, "/embed_all", {"inputs": TEXTS})
    assert served.status_code == 200, served.text
    for got, want in zip(served.json(), written.token_embeddings, strict=True):
        np.testing.assert_allclose(np.array(got, dtype=np.float32).reshape(want.shape), want, atol=1e-6)


def test_cohere_rerank(servers, texts_file, tmp_path):
    """/v1/rerank (Cohere's and infinity's shape): the CLI's scores, best first, cut to top_n."""
    url, model = servers["cross_encoder"]
    done = cli("rerank", str(texts_file), "--query", QUERY, "--model", model, "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    want = pq.read_table(tmp_path / "out" / "part-00000.parquet").column("score").to_numpy()
    served = post(url, "/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 3})
    assert served.status_code == 200, served.text
    results = served.json()["results"]
    best = sorted(range(len(TEXTS)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in results] == best
    np.testing.assert_allclose([r["relevance_score"] for r in results], want[best], atol=1e-5)
