"""``--output-dtype int8 | uint8 | binary | ubinary``: pooled vectors stored as sentence-transformers'
``quantize_embeddings`` quantizes the same float vectors (int8 / uint8 with the ranges of the first part's
vectors as calibration embeddings), read back as stored, resumed with the same ranges."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

import memfit
from conftest import kill_after_first_part
from memfit.errors import ConfigError

QUANTIZED = ["int8", "uint8", "binary", "ubinary"]
TEXTS = [
    f"text {i}: " + " ".join(["the cat", "a dog", "space music", "good movie"][: 1 + i % 4] * (1 + i % 7))
    for i in range(21)
]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir) -> memfit.Encoder:
    return memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch")


@pytest.fixture(scope="module")
def float_output(encoder, tmp_path_factory):
    """The float32 vectors of the same job, parts of 8 texts (the first part is the calibration set)."""
    out = tmp_path_factory.mktemp("f32") / "out"
    encoder.embed_to(TEXTS, out, part_size=8)
    return memfit.read(out)


@pytest.mark.parametrize("output_dtype", QUANTIZED)
def test_stored_vectors_equal_quantize_embeddings_of_the_float_vectors(encoder, float_output, tmp_path, output_dtype):
    from sentence_transformers.quantization import quantize_embeddings

    manifest = encoder.embed_to(TEXTS, tmp_path / "out", part_size=8, output_dtype=output_dtype)
    got = memfit.read(tmp_path / "out")
    floats = float_output.embeddings
    calibration = floats[:8] if output_dtype in ("int8", "uint8") else None
    expected = quantize_embeddings(floats, output_dtype, calibration_embeddings=calibration)
    assert got.embeddings.dtype == expected.dtype and got.embeddings.shape == expected.shape
    np.testing.assert_array_equal(got.embeddings, expected)
    assert len(manifest["parts"]) == 3

    quantization = manifest["quantization"]
    assert quantization["output_dtype"] == output_dtype
    schema = pq.read_schema(tmp_path / "out" / "part-00000.parquet")
    metadata = {k.decode(): v.decode() for k, v in schema.field("embedding").metadata.items()}
    assert metadata["memfit.output_dtype"] == output_dtype and metadata["memfit.meaning"]
    if output_dtype in ("int8", "uint8"):
        ranges = np.vstack([floats[:8].min(axis=0), floats[:8].max(axis=0)])
        np.testing.assert_array_equal(np.asarray(quantization["calibration"]["ranges"], np.float32), ranges)
        assert quantization["calibration"]["rows"] == 8
        np.testing.assert_array_equal(np.asarray(json.loads(metadata["memfit.ranges"]), np.float32), ranges)
    else:
        assert quantization["calibration"] is None


def test_resume_quantizes_with_the_first_runs_ranges(tiny_model_dir, tmp_path):
    """Killed after its first part, a resumed int8 run gives what an uninterrupted one gives."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{TEXTS[i % len(TEXTS)]} {i}\n" for i in range(3000)))
    argv = ["embed", str(source), "--model", tiny_model_dir, "--backend", "torch", "--dtype", "fp32"]
    argv += ["--output-dtype", "int8", "--part-size", "16"]
    kill_after_first_part(argv, tmp_path / "resumed")
    resumed = subprocess.run([sys.executable, "-m", "memfit", *argv, "-o", str(tmp_path / "resumed"), "--resume"])
    whole = subprocess.run([sys.executable, "-m", "memfit", *argv, "-o", str(tmp_path / "whole")])
    assert resumed.returncode == whole.returncode == 0
    a, b = memfit.read(tmp_path / "resumed"), memfit.read(tmp_path / "whole")
    np.testing.assert_array_equal(a.embeddings, b.embeddings)
    assert a.manifest["quantization"] == b.manifest["quantization"]


def test_refusals_name_the_option(encoder, tmp_path):
    with pytest.raises(ConfigError, match="--output-dtype int8 applies to pooled vectors; --tokens"):
        encoder.embed_to(TEXTS, tmp_path / "a", output_dtype="int8", tokens=True)
    with pytest.raises(ConfigError, match="calibrates its ranges on the first part's vectors, and it holds 1"):
        encoder.embed_to(TEXTS[:1], tmp_path / "b", output_dtype="uint8")
    with pytest.raises(ConfigError, match="unknown --output-dtype 'int4'"):
        encoder.embed_to(TEXTS, tmp_path / "c", output_dtype="int4")
    encoder.embed_to(TEXTS[:1], tmp_path / "d", output_dtype="binary")  # bits need no calibration


def test_cli_writes_ubinary(tiny_model_dir, float_output, tmp_path):
    from sentence_transformers.quantization import quantize_embeddings

    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS) + "\n")
    argv = ["embed", str(source), "--model", tiny_model_dir, "--backend", "torch", "--dtype", "fp32"]
    argv += ["--output-dtype", "ubinary"]
    done = subprocess.run([sys.executable, "-m", "memfit", *argv, "-o", str(tmp_path / "out")], capture_output=True)
    assert done.returncode == 0, done.stderr
    got = memfit.read(tmp_path / "out").embeddings
    assert got.dtype == np.uint8 and got.shape == (len(TEXTS), 4)  # 32 dimensions, 8 to a byte
    np.testing.assert_array_equal(got, quantize_embeddings(float_output.embeddings, "ubinary"))


def test_serve_embedding_types(tiny_model_dir):
    from sentence_transformers.quantization import quantize_embeddings
    from test_serve import ThreadServer, post

    from memfit.serve import ServeOptions, create_app

    with ThreadServer(create_app(ServeOptions(model=tiny_model_dir, dtype="fp32"))) as server:
        body = {"input": TEXTS[:5], "embedding_types": ["float", "binary", "ubinary"]}
        data = post(server.url, "/v1/embeddings", body).json()["data"]
        floats = np.array([d["embedding"] for d in data], dtype=np.float32)
        np.testing.assert_array_equal(np.array([d["embeddings"]["float"] for d in data], np.float32), floats)
        for precision in ("binary", "ubinary"):
            got = np.array([d["embeddings"][precision] for d in data])
            np.testing.assert_array_equal(got, quantize_embeddings(floats, precision))
        refused = post(server.url, "/v1/embeddings", {"input": TEXTS[:5], "embedding_types": ["int8"]})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "embedding_types"
        assert "calibration" in refused.json()["error"]["message"]


def test_ray_refuses_calibrated_dtypes_before_starting(tiny_model_dir, tmp_path):
    """Ray workers write parts apart, so they cannot share one calibration: refused before a cluster starts."""
    import memfit.ray

    source = tmp_path / "in.txt"
    source.write_text("a text\nanother\n")
    with pytest.raises(ConfigError, match="--output-dtype int8 calibrates on the first part"):
        memfit.ray.embed_to(str(source), str(tmp_path / "out"), model=tiny_model_dir, output_dtype="int8")
    assert not (tmp_path / "out").exists()
