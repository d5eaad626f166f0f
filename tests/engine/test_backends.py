"""The compiled CPU backend (OpenVINO) against PyTorch and sentence-transformers, its graph cache, and the choice
of backend. The jobs' own tests (test_encoder, test_classify, test_rerank, test_serve, test_budget) run on the
default backend, which is OpenVINO on this CPU; these pin the two backends to each other at the issue's bounds."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

import memfit
from memfit.engine.precision import cosine_rows
from memfit.errors import ConfigError
from conftest import LONG_NEWS_TEXT, sharing_graphs

pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def minilm_pair(minilm_dir):
    """The bundled MiniLM on each backend, fp32."""
    return (
        memfit.Encoder(minilm_dir, dtype="fp32", backend="openvino"),
        memfit.Encoder(minilm_dir, dtype="fp32", backend="torch"),
    )


@pytest.mark.slow
def test_fp32_pooled_vectors_match_pytorch_and_sentence_transformers(minilm_pair, minilm_dir, lee_texts):
    from sentence_transformers import SentenceTransformer

    compiled, eager = minilm_pair
    assert compiled.runtime.backend.name == "openvino" and eager.runtime.backend.name == "torch"
    texts = lee_texts[:48]
    ours = compiled.embed(texts, long="truncate")
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=False)
    assert cosine_rows(ours, reference).min() >= 0.99999
    assert cosine_rows(ours, eager.embed(texts, long="truncate")).min() >= 0.99999


@pytest.mark.slow
def test_fp32_token_vectors_of_a_chunked_long_text_match_pytorch(minilm_pair):
    compiled, eager = minilm_pair
    (ours,) = compiled.embed_tokens([LONG_NEWS_TEXT])
    (theirs,) = eager.embed_tokens([LONG_NEWS_TEXT])
    np.testing.assert_array_equal(ours.token_ids, theirs.token_ids)  # same windows, every token once
    assert len(ours.token_ids) > 2 * compiled.max_length
    assert cosine_rows(ours.embeddings, theirs.embeddings).min() >= 0.99999


@pytest.mark.slow
def test_bf16_passes_the_quality_guard_against_fp32(minilm_dir, lee_texts, tmp_path, openvino_bf16):
    """bf16 on the compiled graph: the guard's own figure ≥ 0.9999, and the vectors ≥ 0.9999 against an fp32
    PyTorch forward measured here."""
    enc = memfit.Encoder(minilm_dir, dtype="bf16", backend="openvino")
    texts = lee_texts[:32]
    vectors = enc.embed(texts, long="truncate")
    assert enc.quality is not None and enc.quality.min_cosine >= 0.9999
    eager = memfit.Encoder(minilm_dir, dtype="fp32", backend="torch").embed(texts, long="truncate")
    assert cosine_rows(vectors, eager).min() >= 0.9999


def test_a_bf16_request_openvino_computes_in_fp32_runs_as_fp32_and_says_so(
    tiny_model_dir, monkeypatch, tmp_path, capsys
):
    """On a CPU without OpenVINO's bf16 kernels (an AVX2-only EPYC: its CPU plugin wants ``avx512_core`` or
    ``avx2_vnni_2``), OpenVINO takes a bf16 precision hint and computes in f32. Here the hint is replaced as that
    plugin does: the run is fp32 and says so in one line, guards nothing (there is no reduced precision to guard),
    and writes fp32 in its manifest, with the vectors of an fp32 compile of the same graph."""
    import openvino

    from memfit.cli import main
    from memfit.engine import models

    compile_model = openvino.Core.compile_model

    def without_bf16(self, graph, device, config):
        if config.get("INFERENCE_PRECISION_HINT") == "bf16":
            config = {**config, "INFERENCE_PRECISION_HINT": "f32"}
        return compile_model(self, graph, device, config)

    monkeypatch.setattr(openvino.Core, "compile_model", without_bf16)
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: False)  # as on that CPU
    texts = [f"text number {i} about the cat and the {i % 7} dogs in the park" for i in range(40)]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    argv = ["embed", str(src), "-o", str(tmp_path / "out"), "--model", tiny_model_dir, "--backend", "openvino"]
    assert main([*argv, "--dtype", "bf16"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert said[:-1] == ["memfit: OpenVINO computes bf16 in fp32 on this CPU: running fp32"]
    assert said[-1].startswith("memfit: wrote 40 embeddings")
    written = memfit.read(tmp_path / "out")
    assert written.manifest["settings"]["dtype"] == "fp32" and written.manifest["quality"] is None
    fp32 = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino").embed(texts)
    np.testing.assert_allclose(written.embeddings, fp32, rtol=1e-6, atol=1e-7)
    # a refusal does not suggest the --dtype bf16 that was asked and computed in fp32
    assert main([*argv[:3], str(tmp_path / "refused"), *argv[4:], "--dtype", "bf16", "--memory-budget", "64MiB"]) == 4
    refusal = capsys.readouterr().err.splitlines()[-1]
    assert "which works" in refusal and "--dtype bf16" not in refusal, refusal


def test_nli_scores_match_pytorch_within_1e_5(tiny_nli_dir):
    texts = ["the cat sat on the mat", "stocks fell sharply on monday", "a new telescope was launched"]
    labels = ["animals", "finance", "space"]
    compiled = memfit.Classifier(tiny_nli_dir, dtype="fp32", backend="openvino")
    eager = memfit.Classifier(tiny_nli_dir, dtype="fp32", backend="torch")
    assert compiled.runtime.backend.name == "openvino"
    for multi_label in (False, True):
        ours = compiled.classify(texts, labels, multi_label=multi_label)
        theirs = eager.classify(texts, labels, multi_label=multi_label)
        for a, b in zip(ours, theirs):
            assert a.labels == b.labels
            np.testing.assert_allclose(a.scores, b.scores, atol=1e-5, rtol=0)


def test_the_second_load_reads_the_cached_graph_without_converting(tiny_model_dir, monkeypatch):
    from memfit.engine.openvino import compiled

    first = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino")
    monkeypatch.setattr(
        compiled, "convert_in_child", lambda *args: pytest.fail("the cached graph should have been used")
    )
    second = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino")
    assert second.runtime.backend.graph.source == "cache"
    texts = ["a short text", "another one, a little longer than the first"]
    np.testing.assert_array_equal(first.embed(texts), second.embed(texts))


def test_changed_weights_get_a_new_graph(tiny_model_dir, tmp_path):
    """The cache is keyed by the files' content: a fine-tuned copy in the same place is converted again."""
    from transformers import AutoModel

    from memfit.engine.openvino.cache import graph_file

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    before = graph_file(str(copy), "last_hidden_state")
    model = AutoModel.from_pretrained(copy)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.mul_(2)
    model.save_pretrained(copy)
    after = graph_file(str(copy), "last_hidden_state")
    assert before != after
    texts = ["the same text twice"]
    changed = memfit.Encoder(str(copy), dtype="fp32", backend="openvino").embed(texts)
    reference = memfit.Encoder(str(copy), dtype="fp32", backend="torch").embed(texts)
    assert cosine_rows(changed, reference).min() >= 0.99999


CONVERT_AT_ONCE = r"""
import logging, sys, time
from pathlib import Path
import numpy as np
import memfit
logging.basicConfig(level=logging.INFO, format="%(message)s")
model, barrier, me, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
(barrier / me).touch()
while len(list(barrier.iterdir())) < 2:  # both processes imported memfit: they ask for the graph together
    time.sleep(0.01)
np.save(out, memfit.Encoder(model, dtype="fp32", backend="openvino").embed(["two processes, one conversion"]))
"""


def test_processes_that_start_on_one_model_at_once_convert_it_once(tiny_model_dir, tmp_path):
    """Ray's workers on one node start together on a fresh cache: one converts, the others wait and read its graph
    (before, each ran its own conversion child beside the others and wrote the same files). The same holds for two
    copies of one model in two folders, such as one test model built by two test workers: the second process here
    reads a copy (the lock was its folder's, and both converted)."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(tmp_path / "cache")}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_AT_ONCE, model, str(barrier), name, str(tmp_path / f"{name}.npy")],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, model in (("first", tiny_model_dir), ("second", str(copy)))
    ]
    logs = [process.communicate(timeout=300)[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], logs
    assert sorted("OpenVINO graph converted and cached" in log for log in logs) == [False, True], logs
    assert sum("OpenVINO graph from the cache" in log for log in logs) == 1, logs
    reference = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch").embed(["two processes, one conversion"])
    for name in ("first", "second"):
        assert cosine_rows(np.load(tmp_path / f"{name}.npy"), reference).min() >= 0.99999


def test_backend_choices(tiny_model_dir, monkeypatch):
    from memfit.engine.openvino import backend
    from memfit.engine.registry import candidate_backends

    def first(*args) -> str:
        return candidate_backends(*args)[0].name

    cpu = torch.device("cpu")
    assert first("auto", cpu, "fp32", "none") == "openvino"
    assert first("auto", cpu, "fp16", "none") == "torch"
    assert first("auto", torch.device("cuda"), "bf16", "none") == "torch"
    monkeypatch.setattr(backend, "nncf_version", lambda: "3.4.0")
    assert first("auto", cpu, "fp32", "int8") == "openvino"  # NNCF quantizes the graph
    monkeypatch.setattr(backend, "nncf_version", lambda: None)
    assert first("auto", cpu, "fp32", "int8") == "torch"  # no NNCF: PyTorch's dynamic int8
    with pytest.raises(ConfigError, match=r"--quantize int8 on --backend openvino needs NNCF \(pip install"):
        candidate_backends("openvino", cpu, "fp32", "int8")
    with pytest.raises(ConfigError, match="runs on the CPU"):
        candidate_backends("openvino", torch.device("cuda"), "bf16", "none")
    with pytest.raises(ConfigError, match="unknown backend"):
        candidate_backends("onnx", cpu, "fp32", "none")


def test_every_registered_backend_is_a_cli_choice_and_nothing_above_the_engine_names_one():
    import ast
    from pathlib import Path

    from memfit.defaults import BACKEND_CHOICES
    from memfit.engine.registry import BACKENDS

    assert set(BACKEND_CHOICES) == {"auto", *BACKENDS}
    src = Path(memfit.__file__).parent
    # a backend's own modules: engine/NAME_backend.py, or those of its package engine/NAME/ (where its kind is)
    packages = {kind.load.__module__.rpartition(".")[0] for kind in BACKENDS.values()} - {"memfit.engine"}

    def a_backends_module(module: str) -> bool:
        return module.endswith("_backend") or any(module == p or module.startswith(f"{p}.") for p in packages)

    offenders = []
    for path in sorted(src.rglob("*.py")):
        if path.relative_to(src).parts[0] == "engine" or path.name == "defaults.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            # an import of a backend's own module, or code comparing against a backend's name
            if isinstance(node, ast.ImportFrom) and node.module and a_backends_module(node.module):
                offenders.append(f"{path.relative_to(src)}:{node.lineno} imports {node.module}")
            if isinstance(node, ast.Compare):
                names = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                where = f"{path.relative_to(src)}:{node.lineno}"
                offenders += [f"{where} compares with {name!r}" for name in names if name in BACKENDS]
    assert not offenders, offenders


def test_a_model_that_does_not_convert_falls_back_to_pytorch_under_auto(tiny_model_dir, monkeypatch, caplog):
    from memfit.engine.openvino import backend, compiled
    from memfit.errors import ModelLoadError

    def fails(*args):
        raise ModelLoadError("OpenVINO cannot convert this model (TypeError: unsupported); use --backend torch")

    monkeypatch.setattr(backend, "graph_file", lambda *args: None)
    monkeypatch.setattr(compiled, "graph_file", lambda *args: None)
    monkeypatch.setattr(compiled, "convert_in_child", fails)
    with caplog.at_level("WARNING", logger="memfit"):
        enc = memfit.Encoder(tiny_model_dir, dtype="fp32")
    assert enc.runtime.backend.name == "torch" and "running it on PyTorch" in caplog.text
    with pytest.raises(ModelLoadError, match="cannot convert"):
        memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino")


def test_a_graph_openvino_cannot_compile_is_one_line_or_pytorch_under_auto(tiny_model_dir, monkeypatch, caplog):
    """OpenVINO refuses some graphs in some precisions on some CPUs (seen: bf16 with the ISA held to AVX2 by
    ``ONEDNN_MAX_CPU_ISA``, which raised a multi-line RuntimeError and ended memfit in a traceback)."""
    import openvino

    from memfit.errors import ModelLoadError

    memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino")  # the graph is cached: only compiling fails

    def refuses(self, *args, **kwargs):
        raise RuntimeError(
            "Exception from src/inference/src/cpp/core.cpp:117:\nSupported primitive descriptors list "
            "is empty for node: Softmax_1 type: Softmax\n\n"
        )

    monkeypatch.setattr(openvino.Core, "compile_model", refuses)
    with pytest.raises(ModelLoadError) as refused:
        memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino")
    message = str(refused.value)
    assert "\n" not in message and "cannot compile the graph in fp32" in message and "Softmax_1" in message
    with caplog.at_level("WARNING", logger="memfit"):
        enc = memfit.Encoder(tiny_model_dir, dtype="fp32")
    assert enc.runtime.backend.name == "torch" and "running it on PyTorch" in caplog.text


def test_auto_bf16_that_openvino_cannot_compile_runs_the_graph_in_fp32(tiny_model_dir, monkeypatch, caplog):
    """``auto`` never ends slower than fp32 PyTorch: a bf16 graph OpenVINO refuses is compiled in fp32, not run on
    PyTorch in bf16 (which on a CPU held to AVX2 is slower than fp32)."""
    import openvino

    from memfit.engine import runtime

    compile_model = openvino.Core.compile_model

    def refuses_bf16(self, model, device, config=None):
        if str(config.get("INFERENCE_PRECISION_HINT")) == "bf16":
            raise RuntimeError("Supported primitive descriptors list is empty for node: Softmax_1 type: Softmax")
        return compile_model(self, model, device, config)

    monkeypatch.setattr(openvino.Core, "compile_model", refuses_bf16)

    def as_on_a_bf16_cpu(dtype, quantize, device, resolve=runtime.resolve_precision):
        return ("bf16", "none") if dtype == "auto" else resolve(dtype, quantize, device)

    monkeypatch.setattr(runtime, "resolve_precision", as_on_a_bf16_cpu)
    with caplog.at_level("WARNING", logger="memfit"):
        enc = memfit.Encoder(tiny_model_dir, dtype="auto")
    assert (enc.runtime.backend.name, enc.runtime.dtype) == ("openvino", "fp32"), caplog.text
    assert "running it in fp32" in caplog.text
    reference = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino")
    texts = ["a short text", "another, a little longer"]
    np.testing.assert_array_equal(enc.embed(texts), reference.embed(texts))


def test_the_manifest_and_plan_name_the_backend(tiny_model_dir, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("one text\nanother text\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit",
            "embed",
            str(src),
            "-o",
            str(tmp_path / "out"),
            "--model",
            tiny_model_dir,
            "--dtype",
            "fp32",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["settings"]["backend"] == "openvino"
    plan = subprocess.run(
        [sys.executable, "-m", "memfit", "plan", "--model", tiny_model_dir, "--backend", "torch", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["backend"] == "torch"


def test_auto_bf16_that_fails_the_guard_runs_fp32_instead_of_refusing(
    tiny_model_dir, monkeypatch, tmp_path, openvino_bf16
):
    """dtype=auto on the compiled backend: a bf16 that fails the guard on the caller's texts is replaced by fp32
    (no refusal), for the whole streamed job; the manifest keeps the failed measurement. An explicit bf16 still
    refuses."""
    from memfit.engine import models, precision

    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(precision, "DEFAULT_MIN_COSINE", {**precision.DEFAULT_MIN_COSINE, "bf16": 1.5})  # unmeetable
    texts = [f"text number {i} about the cat and the {i % 7} dogs in the park" for i in range(40)]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    enc = memfit.Encoder(tiny_model_dir)
    assert enc.runtime.dtype == "bf16" and enc.runtime.backend.name == "openvino"
    bf16_network = weakref.ref(enc.runtime.backend)
    manifest = enc.embed_to(str(src), tmp_path / "out")
    assert enc.runtime.dtype == "fp32" and manifest["settings"]["dtype"] == "bf16"  # what was asked and guarded
    gc.collect()
    assert bf16_network() is None  # nothing the job keeps (its guard's releases) holds the bf16 network
    fp32 = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="openvino").embed(texts)
    # the failed measurement it keeps is what the bf16 graph's own vectors show against fp32's
    bf16 = memfit.Encoder(tiny_model_dir, dtype="bf16", backend="openvino", quality_check=False).embed(texts)
    assert manifest["quality"]["fell_back_to"] == "fp32"
    assert manifest["quality"]["min_cosine"] == pytest.approx(cosine_rows(bf16, fp32).min(), abs=2e-5)
    np.testing.assert_allclose(memfit.read(tmp_path / "out").embeddings, fp32, rtol=1e-6, atol=1e-7)
    with pytest.raises(memfit.QualityError):
        memfit.Encoder(tiny_model_dir, dtype="bf16").embed(texts)


def test_auto_reuses_a_clear_pass_of_the_guard_measured_on_this_machine(
    tiny_model_dir, monkeypatch, tmp_path, openvino_bf16
):
    """dtype=auto on the compiled bf16 graph: a pass measured by one run on the guard's 64 texts stands for the next
    run of the same graph, precision, pooling and CPU (no fp32 copy, no second pass), and says so; one on fewer texts,
    one that cleared the threshold by less than the margin, an explicit bf16 or a caller's threshold is measured
    again."""
    import memfit.jobs.encoder as encoder_module
    from memfit.engine import models
    from memfit.memory.calibration import cache_dir

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(sharing_graphs(tmp_path / "cache")))
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: True)
    measured: list[int] = []
    real_measure = encoder_module.measure_quality

    def counting_measure(*args, **kwargs):
        measured.append(1)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(encoder_module, "measure_quality", counting_measure)
    texts = [f"text number {i} about the cat and the {i % 7} dogs in the park" for i in range(64)]
    # a pass on fewer than the guard's 64 texts (a short job, memfit serve's warm-up) is not kept for later runs
    for _ in range(2):
        memfit.Encoder(tiny_model_dir).embed(texts[:10])
    assert len(measured) == 2
    measured.clear()
    first = memfit.Encoder(tiny_model_dir)
    assert first.runtime.dtype == "bf16" and first.runtime.backend.name == "openvino"
    first.embed(texts)
    assert len(measured) == 1 and first.quality.source == "measured" and first.quality.passed

    second = memfit.Encoder(tiny_model_dir)
    vectors = second.embed(texts[::-1])
    assert len(measured) == 1, "the second run measured again"
    assert second.quality.source == "cache" and second.quality.min_cosine == first.quality.min_cosine
    np.testing.assert_allclose(vectors[::-1], first.embed(texts), rtol=1e-6, atol=1e-7)  # same graph, same output
    # classify's embedding mode (and memfit serve) hand the Encoder a loaded runtime: auto's pass stands there too
    classifier = memfit.Classifier(tiny_model_dir)
    assert classifier.mode == "embedding" and classifier.runtime.dtype == "bf16"
    classifier.classify(texts, ["cats", "dogs"])
    assert len(measured) == 1 and classifier.encoder.quality.source == "cache"

    memfit.Encoder(tiny_model_dir, dtype="bf16").embed(texts)  # an explicit precision is measured every run
    assert len(measured) == 2
    memfit.Classifier(tiny_model_dir, dtype="bf16").classify(texts, ["cats", "dogs"])  # in classify too
    assert len(measured) == 3
    memfit.Encoder(tiny_model_dir, min_cosine=0.999).embed(texts)  # and a threshold of the caller's
    assert len(measured) == 4

    (verdict,) = (cache_dir() / "quality").glob("*.json")
    stored = json.loads(verdict.read_text())
    stored["report"]["min_cosine"] = 0.9995  # passes 0.999, but not 4x closer to 1
    verdict.write_text(json.dumps(stored))
    third = memfit.Encoder(tiny_model_dir)
    third.embed(texts)
    assert len(measured) == 5 and third.quality.source == "measured"


def test_importing_openvino_sends_no_telemetry(tmp_path):
    """OpenVINO's conversion tools start a thread that sends a usage event on import unless the user opted out in
    ~/intel; memfit declines it (a fresh HOME, not in CI: what a user's first run sees)."""
    probe = (
        "import threading\n"
        "from memfit.engine.openvino.cache import import_openvino\n"
        "import_openvino()\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['MainThread']"
    assert not (tmp_path / "intel" / "openvino_ga_cid").exists()  # no client id written either


@pytest.mark.slow
def test_int8_on_the_compiled_backend_keeps_the_ffn_outputs_in_float_and_passes_the_guard(
    minilm_dir, lee_texts, monkeypatch
):
    """``--quantize int8`` with NNCF installed: an int8 copy of the graph, cached beside the fp32 one, with every
    linear layer's input quantized except the feed-forward output projections (their weights stay float
    constants), the rest in ``auto``'s float precision. Its vectors against sentence-transformers fp32 stay above
    the guard's 0.99 (measured 0.9975 on these texts), and the guard measured what the test measures."""
    pytest.importorskip("nncf")
    from openvino import Core
    from sentence_transformers import SentenceTransformer

    from memfit.engine.models import resolve_dtype
    from memfit.engine.openvino import cache, compiled

    texts = lee_texts[:32]
    encoder = memfit.Encoder(minilm_dir, quantize="int8", max_length=256)
    graph = encoder.runtime.backend.graph
    assert encoder.runtime.backend.name == "openvino" and encoder.quantize == "int8" and graph.int8
    assert encoder.dtype == resolve_dtype("auto", torch.device("cpu"))
    assert graph.source_graph == cache.int8_graph_file(graph.fp32_graph)

    linear = {}
    for op in Core().read_model(str(graph.source_graph)).get_ordered_ops():
        name = op.get_friendly_name()
        if op.get_type_name() == "MatMul" and ".layer." in name and "aten::linear" in name:
            linear[name] = [i.get_source_output().get_node().get_type_name() for i in op.inputs()]
    ffn_out = {name for name in linear if ".output.dense" in name and ".attention." not in name}
    assert len(linear) == 6 * 6 and len(ffn_out) == 6
    assert all("FakeQuantize" not in inputs and "Constant" in inputs for n, inputs in linear.items() if n in ffn_out)
    assert all("FakeQuantize" in inputs for n, inputs in linear.items() if n not in ffn_out)

    ours = encoder.embed(texts, long="truncate")
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=False)
    cosines = cosine_rows(ours, reference)
    assert cosines.min() >= 0.99
    assert encoder.quality is not None and encoder.quality.precision == "int8"
    assert encoder.quality.min_cosine == pytest.approx(cosines.min(), abs=1e-4)  # static int8: batch-independent

    monkeypatch.setattr(
        compiled, "convert_in_child", lambda *args: pytest.fail("the cached int8 graph should have been used")
    )
    again = memfit.Encoder(minilm_dir, quantize="int8", max_length=256, min_cosine=0.0)
    assert again.runtime.backend.graph.source == "cache"
    np.testing.assert_allclose(again.embed(texts, long="truncate"), ours, rtol=0, atol=1e-5)
