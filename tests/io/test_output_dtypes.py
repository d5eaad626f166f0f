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
    from http_server import ThreadServer, post

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
        assert "--quantization-ranges" in refused.json()["error"]["message"]  # how to enable them


@pytest.fixture(scope="module")
def int8_output(encoder, tmp_path_factory):
    """TEXTS embedded as a search index's documents: normalized (as the server answers by default) and stored as
    int8, the first part's 8 vectors calibrating the ranges."""
    out = tmp_path_factory.mktemp("int8") / "out"
    encoder.embed_to(TEXTS, out, part_size=8, normalize=True, output_dtype="int8")
    return out


def recorded_ranges(out) -> np.ndarray:
    """The ranges as the manifest's JSON holds them (not through memfit's reader)."""
    manifest = json.loads((out / "manifest.json").read_text())
    return np.asarray(manifest["quantization"]["calibration"]["ranges"], dtype=np.float32)


def assert_stored_levels(data, precision, stored, ranges, atol=1e-6) -> None:
    """The served levels are sentence-transformers' of the served floats with ``ranges``, and the levels an embed run
    stored for the same texts are too, to within the floats' parity with the command (1e-6: another batch sums in
    another order), which can move a value across a step boundary (a calibration vector's maximum lies on one)."""
    from sentence_transformers.quantization import quantize_embeddings

    floats = np.array([d["embedding"] for d in data], dtype=np.float32)
    got = np.array([d["embeddings"][precision] for d in data])
    np.testing.assert_array_equal(got, quantize_embeddings(floats, precision, ranges=ranges))
    low = quantize_embeddings(floats - atol, precision, ranges=ranges)
    high = quantize_embeddings(floats + atol, precision, ranges=ranges)
    assert ((low <= stored) & (stored <= high)).all(), (got, stored)


def serve_options(tiny_model_dir, **options):
    from memfit.serve import ServeOptions

    return ServeOptions(model=tiny_model_dir, dtype="fp32", backend="torch", **options)


def test_serve_quantizes_int8_and_uint8_with_the_ranges_of_an_embed_run(tiny_model_dir, int8_output):
    """--quantization-ranges: int8 / uint8 answers are sentence-transformers' quantize_embeddings of the served
    floats with the recorded ranges, so the corpus's own texts come back with the levels the embed run stored."""
    from sentence_transformers.quantization import quantize_embeddings
    from http_server import ThreadServer, post

    from memfit.serve import create_app

    ranges = recorded_ranges(int8_output)
    stored = memfit.read(int8_output).embeddings
    options = serve_options(tiny_model_dir, quantization_ranges=str(int8_output / "manifest.json"))
    with ThreadServer(create_app(options)) as server:
        queries = TEXTS[5:14] + ["good movie, space music and a dog"]  # past the calibration part, and a new text
        answer = post(server.url, "/v1/embeddings", {"input": queries, "embedding_types": ["int8", "uint8", "float"]})
        assert answer.status_code == 200, answer.text
        data = answer.json()["data"]
        floats = np.array([d["embedding"] for d in data], dtype=np.float32)
        np.testing.assert_array_equal(np.array([d["embeddings"]["float"] for d in data], np.float32), floats)
        for precision in ("int8", "uint8"):
            got = np.array([d["embeddings"][precision] for d in data])
            expected = quantize_embeddings(floats, precision, ranges=ranges)
            np.testing.assert_array_equal(got, expected)
            # the request's own ranges would give other levels: the test tells recorded ranges from calibrating anew
            assert not np.array_equal(got, quantize_embeddings(floats, precision))
        assert_stored_levels(data[:9], "int8", stored[5:14], ranges)

        whole = post(
            server.url, "/v1/embeddings", {"input": TEXTS[:3], "embedding_types": ["int8"], "dimensions": 32}
        )  # the ranges' own width, asked for explicitly
        assert whole.status_code == 200, whole.text
        assert_stored_levels(whole.json()["data"], "int8", stored[:3], ranges)

        shorter = {"input": TEXTS[:3], "embedding_types": ["float", "uint8"], "dimensions": 16}
        refused = post(server.url, "/v1/embeddings", shorter)
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error == {
            "message": error["message"],
            "type": "invalid_request_error",
            "param": "dimensions",
            "code": 422,
        }
        assert error["message"].startswith("field 'dimensions': uint8 quantizes with the ranges of --quantization")
        assert "dimensions must be 32 (or left out)" in error["message"]
        assert post(server.url, "/v1/embeddings", {**shorter, "embedding_types": ["float"]}).status_code == 200


def test_serve_quantizes_the_leading_dimensions_an_embed_run_kept(encoder, tiny_model_dir, tmp_path):
    """A corpus embedded with --dimensions 16 recorded ranges of 16 dimensions: requests for int8 ask for those 16."""
    from http_server import ThreadServer, post

    from memfit.serve import create_app

    encoder.embed_to(TEXTS, tmp_path / "out", part_size=8, normalize=True, dimensions=16, output_dtype="uint8")
    stored = memfit.read(tmp_path / "out").embeddings
    assert stored.shape == (len(TEXTS), 16)
    with ThreadServer(create_app(serve_options(tiny_model_dir, quantization_ranges=str(tmp_path / "out")))) as server:
        body = {"input": TEXTS[:6], "embedding_types": ["uint8"], "dimensions": 16}
        answer = post(server.url, "/v1/embeddings", body)
        assert answer.status_code == 200, answer.text
        assert_stored_levels(answer.json()["data"], "uint8", stored[:6], recorded_ranges(tmp_path / "out"))
        refused = post(server.url, "/v1/embeddings", {"input": TEXTS[:6], "embedding_types": ["uint8"]})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "dimensions"
        assert "dimensions must be 16 to ask for it" in refused.json()["error"]["message"]


def edited_copy(out, path, edit) -> str:
    """A copy of ``out``'s manifest in ``path``, changed by ``edit`` (the ranges or settings of another run)."""
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps(manifest))
    return str(path)


def test_serve_refuses_ranges_that_do_not_describe_its_vectors(
    encoder, tiny_model_dir, tiny_nli_dir, int8_output, tmp_path
):
    from memfit.serve import ServeOptions, create_app
    from memfit.serve.host import ServerHost

    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=f"--quantization-ranges {missing}: .*no manifest.json") as refusal:
        create_app(serve_options(tiny_model_dir, quantization_ranges=str(missing)))
    assert "'memfit embed --output-dtype int8' (or uint8) run" in str(refusal.value)
    assert refusal.value.field == "quantization_ranges"
    encoder.embed_to(TEXTS[:2], tmp_path / "bits", output_dtype="ubinary")
    with pytest.raises(ConfigError, match=r"records no int8 / uint8 calibration ranges \(output dtype ubinary\)"):
        create_app(serve_options(tiny_model_dir, quantization_ranges=str(tmp_path / "bits")))

    def narrower(manifest):
        calibration = manifest["quantization"]["calibration"]
        calibration["ranges"] = [row[:16] for row in calibration["ranges"]]

    def other_model(manifest):
        manifest["settings"]["model"] = "sentence-transformers/all-MiniLM-L6-v2"

    def other_pooling(manifest):
        manifest["settings"]["pooling"] = "cls"

    refusals = [
        (narrower, {}, "its ranges cover 16 dimensions, and the served model's vectors have 32"),
        (other_model, {}, "calibrated on vectors of sentence-transformers/all-MiniLM-L6-v2, and this server serves"),
        (other_pooling, {}, "calibrated on cls-pooled vectors, and this server pools by mean"),
        (None, {"normalize": False}, "calibrated on normalized vectors, and this server answers unnormalized ones"),
    ]
    for i, (edit, extra, message) in enumerate(refusals):
        ranges = int8_output if edit is None else edited_copy(int8_output, tmp_path / f"edited-{i}", edit)
        options = serve_options(tiny_model_dir, quantization_ranges=str(ranges), **extra)
        create_app(options)  # the manifest has ranges: what they fit is known once the model is loaded
        with pytest.raises(ConfigError, match=message):
            ServerHost(options)
    classifier = ServeOptions(model=tiny_nli_dir, dtype="fp32", backend="torch", quantization_ranges=str(int8_output))
    with pytest.raises(ConfigError, match="this server hosts a nli classifier, which answers none"):
        ServerHost(classifier)


def test_memfit_serve_without_ranges_at_the_path_stops_with_one_line(tiny_model_dir, tmp_path):
    from http_server import free_port

    argv = ["serve", "--model", tiny_model_dir, "--port", str(free_port()), "--quantization-ranges", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"memfit: error: --quantization-ranges {tmp_path}: {tmp_path}: no manifest.json; not a memfit output "
        "directory; the output directory of a 'memfit embed --output-dtype int8' (or uint8) run has them"
    ]


def test_ray_refuses_calibrated_dtypes_before_starting(tiny_model_dir, tmp_path):
    """Ray workers write parts apart, so they cannot share one calibration: refused before a cluster starts."""
    import memfit.ray

    source = tmp_path / "in.txt"
    source.write_text("a text\nanother\n")
    with pytest.raises(ConfigError, match="--output-dtype int8 calibrates on the first part"):
        memfit.ray.embed_to(str(source), str(tmp_path / "out"), model=tiny_model_dir, output_dtype="int8")
    assert not (tmp_path / "out").exists()
