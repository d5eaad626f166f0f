"""``dimensions`` (Matryoshka): pooled vectors cut to their first N dimensions, then normalized when asked,
against sentence-transformers' own ``truncate_dim``, in Python, on the command line and on ``memfit serve``."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest

import memfit
from memfit.errors import ConfigError

TEXTS = ["the cat sat on the mat", "hello world, a good example", "", " ".join(["a long text of the world"] * 40)]


@pytest.fixture(scope="module")
def model_dir(tiny_prompt_dirs) -> str:
    return tiny_prompt_dirs["mean"]  # a full sentence-transformers directory, with a default prompt


@pytest.fixture(scope="module")
def encoder(model_dir) -> memfit.Encoder:
    return memfit.Encoder(model_dir, dtype="fp32", backend="torch")


@pytest.mark.parametrize("dimensions", [1, 8, 16, 32])
@pytest.mark.parametrize("normalize", [False, True])
def test_equal_sentence_transformers_truncate_dim(encoder, model_dir, dimensions, normalize):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(model_dir, device="cpu", truncate_dim=dimensions).encode(
        TEXTS, normalize_embeddings=normalize, convert_to_numpy=True
    )
    ours = encoder.embed(TEXTS, long="truncate", normalize=normalize, dimensions=dimensions)
    assert ours.shape == (len(TEXTS), dimensions)
    np.testing.assert_allclose(ours, reference, atol=1e-5)


@pytest.mark.parametrize("dimensions", [0, 33, -1])
def test_dimensions_outside_the_model_are_refused(encoder, dimensions):
    with pytest.raises(ConfigError, match=rf"--dimensions must be between 1 and the model's 32, got {dimensions}"):
        encoder.embed(["x"], dimensions=dimensions)


def test_a_model_not_trained_for_it_works_with_a_note_once(model_dir, tmp_path, caplog):
    import memfit.jobs.encoder as encoder_module

    encoder_module._note_not_matryoshka.cache_clear()
    plain = memfit.Encoder(model_dir, dtype="fp32", backend="torch")
    with caplog.at_level(logging.WARNING, logger="memfit"):
        plain.embed(["x"], dimensions=8)
        plain.embed(["y"], dimensions=4)
    notes = [r.getMessage() for r in caplog.records if "Matryoshka" in r.getMessage()]
    assert len(notes) == 1 and "names no Matryoshka training" in notes[0]

    trained = tmp_path / "matryoshka"
    shutil.copytree(model_dir, trained)
    (trained / "README.md").write_text("---\ntags:\n- loss:MatryoshkaLoss\n---\n# a model\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        memfit.Encoder(str(trained), dtype="fp32", backend="torch").embed(["x"], dimensions=8)
    assert not [r for r in caplog.records if "Matryoshka" in r.getMessage()]


def _memfit(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, timeout=300)


def test_cli_dimensions_with_tokens_round_trip(model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS[:2]) + "\n")
    out = tmp_path / "out"
    done = _memfit(
        "embed", str(source), "--model", model_dir, "--dtype", "fp32", "--dimensions", "8", "--normalize", "--tokens",
        "-o", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = memfit.read(out)
    reference = SentenceTransformer(model_dir, device="cpu", truncate_dim=8).encode(
        TEXTS[:2], normalize_embeddings=True
    )
    np.testing.assert_allclose(got.embeddings, reference, atol=1e-5)
    assert got.manifest["dim"] == 8 and got.manifest["settings"]["dimensions"] == 8
    assert all(t.shape[1] == 32 for t in got.token_embeddings)  # token rows keep the model's width
    assert "names no Matryoshka training" in done.stderr


@pytest.mark.parametrize("value, message", [("33", "between 1 and the model's 32, got 33"), ("0", "at least 1")])
def test_cli_refuses_bad_dimensions_in_one_line(model_dir, tmp_path, value, message):
    source = tmp_path / "in.txt"
    source.write_text("a text\n")
    done = _memfit(
        "embed",
        str(source),
        "--model",
        model_dir,
        "--backend",
        "torch",
        "--dimensions",
        value,
        "-o",
        str(tmp_path / "o"),
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--dimensions" in lines[0] and message in lines[0], done.stderr
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_serve_dimensions_on_tei_and_openai_routes(model_dir):
    from sentence_transformers import SentenceTransformer
    from http_server import ThreadServer, post

    from memfit.serve import ServeOptions, create_app

    texts = TEXTS[:2]
    reference = SentenceTransformer(model_dir, device="cpu", truncate_dim=8).encode(texts, normalize_embeddings=True)
    with ThreadServer(create_app(ServeOptions(model=model_dir, dtype="fp32"))) as server:
        tei = post(server.url, "/embed", {"inputs": texts, "dimensions": 8}).json()
        np.testing.assert_allclose(np.array(tei), reference, atol=1e-5)
        openai = post(server.url, "/v1/embeddings", {"input": texts, "dimensions": 8}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in openai["data"]]), reference, atol=1e-5)
        too_many = post(server.url, "/embed", {"inputs": texts, "dimensions": 33})
        assert too_many.status_code == 422 and "field 'dimensions'" in too_many.json()["error"]
