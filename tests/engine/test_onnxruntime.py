"""ONNX Runtime (``--backend onnxruntime``) against sentence-transformers and PyTorch, its graph cache, and what it
refuses. Its budget is held in tests/memory/test_budget.py with the other backends'."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import memfit
from memfit.cli import main
from memfit.engine.precision import cosine_rows
from memfit.errors import ConfigError
from conftest import LONG_NEWS_TEXT, memfit_imports, sharing_graphs

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def minilm_onnx(minilm_dir):
    return memfit.Encoder(minilm_dir, dtype="fp32", backend="onnxruntime")


@pytest.mark.slow
def test_pooled_vectors_match_sentence_transformers(minilm_onnx, minilm_dir, lee_texts):
    from sentence_transformers import SentenceTransformer

    assert minilm_onnx.runtime.backend.name == "onnxruntime" and minilm_onnx.runtime.dtype == "fp32"
    texts = lee_texts[:48]
    ours = minilm_onnx.embed(texts, long="truncate")
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=False)
    assert cosine_rows(ours, reference).min() >= 0.99999


@pytest.mark.slow
def test_token_vectors_of_a_chunked_long_text_match_a_pytorch_forward(minilm_onnx, minilm_dir):
    """Every window of a long text: the same tokens as PyTorch's run, and vectors within fp32's tolerance of it."""
    (ours,) = minilm_onnx.embed_tokens([LONG_NEWS_TEXT])
    (theirs,) = memfit.Encoder(minilm_dir, dtype="fp32", backend="torch").embed_tokens([LONG_NEWS_TEXT])
    np.testing.assert_array_equal(ours.token_ids, theirs.token_ids)
    assert len(ours.token_ids) > 2 * minilm_onnx.max_length
    assert cosine_rows(ours.embeddings, theirs.embeddings).min() >= 0.99999


def _tiny_architecture(architecture: str) -> tuple[torch.nn.Module, int, bool]:
    """A random-weight 2-layer model of ``architecture`` (hidden 32, 4 heads), its pad id, and whether it takes
    segment ids."""
    from transformers import (
        AlbertConfig,
        AlbertModel,
        BertConfig,
        BertModel,
        MPNetConfig,
        MPNetModel,
        RobertaConfig,
        RobertaModel,
    )

    shape = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    shape |= dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(3)
    if architecture == "bert":
        return BertModel(BertConfig(max_position_embeddings=64, **shape)).eval(), 0, True
    if architecture == "roberta":  # positions offset by the padding id, no segment ids
        return RobertaModel(RobertaConfig(max_position_embeddings=66, pad_token_id=1, **shape)).eval(), 1, False
    if architecture == "albert":  # one layer's weights shared by both: the optimizer fuses one of the two
        return AlbertModel(AlbertConfig(max_position_embeddings=64, embedding_size=16, **shape)).eval(), 0, True
    return MPNetModel(MPNetConfig(max_position_embeddings=66, pad_token_id=1, **shape)).eval(), 1, False


@pytest.mark.parametrize(("architecture", "fused_layers"), [("bert", 2), ("roberta", 2), ("mpnet", 0), ("albert", 0)])
def test_the_export_fuses_each_layers_attention_where_it_can_and_equals_pytorch_on_padded_windows(
    architecture, fused_layers, tmp_path
):
    """BERT's and RoBERTa's graphs run each layer's attention as ONNX Runtime's fused ``Attention`` (1.76-1.83x the
    plain graph at 512-token windows, docs/benchmarks.md), and say so to the memory model, whose calibrations of the
    two kinds of graph must not mix; MPNet's attention, with its relative position bias, is not the pattern that
    fuses, and ALBERT's fuses in only one of its layers: both keep the plain export. Either way the graph's hidden
    states on the real tokens of windows padded to different lengths are a PyTorch forward's, from a copy of the
    module that was never traced."""
    import copy

    import onnx
    import onnxruntime

    from memfit.engine.onnx_export import export
    from memfit.engine.onnxruntime_backend import OnnxSession, session_network

    model, pad, with_token_types = _tiny_architecture(architecture)
    reference = copy.deepcopy(model)
    path = tmp_path / "model.onnx"
    export(model, "last_hidden_state", with_token_types, path)
    assert not model.training  # the export leaves the module as it found it
    operators = [node.op_type for node in onnx.load(str(path)).graph.node]
    assert operators.count("Attention") == fused_layers, sorted(set(operators))

    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(5, 120, (4, 40), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate((40, 33, 17, 3)):
        mask[row, length:] = 0
    ids[mask == 0] = pad
    inputs = {"input_ids": ids, "attention_mask": mask} | (
        {"token_type_ids": torch.zeros_like(ids)} if with_token_types else {}
    )
    with torch.inference_mode():
        expected = reference(**inputs).last_hidden_state.numpy()
        np.testing.assert_array_equal(model(**inputs).last_hidden_state.numpy(), expected)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})[0]
    real = mask.numpy().astype(bool)
    np.testing.assert_allclose(got[real], expected[real], rtol=0, atol=1e-5)
    network = session_network(OnnxSession(session, None, tuple(inputs), path, True), model.config, "last_hidden_state")
    assert network.attention == ("onnxruntime fused" if fused_layers else "onnxruntime")


def test_a_conversion_child_killed_by_a_signal_runs_once_more_as_asked_and_an_error_is_not_retried(tmp_path):
    """The ONNX export runs again without the fused attention when its child is killed (out of memory: the fusion
    holds it at 1.3-1.4x the plain export's peak); a child that fails by itself reports its own error."""
    import sys

    from memfit.engine.graph_cache import run_conversion_child
    from memfit.errors import ModelLoadError

    marker = tmp_path / "ran again"
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    again = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    run_conversion_child(killed, "failed", after_a_signal=again)
    assert marker.exists()
    with pytest.raises(ModelLoadError, match="failed"):
        run_conversion_child(killed, "failed")
    marker.unlink()
    refused = [sys.executable, "-c", "import sys; print('memfit: no such model', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(ModelLoadError, match="^no such model$"):
        run_conversion_child(refused, "failed", after_a_signal=again)
    assert not marker.exists()


def test_nli_scores_match_the_pipeline_within_1e_5(tiny_nli_dir):
    from transformers import pipeline

    texts = ["the cat sat on the mat", "stocks fell sharply on monday", "a new telescope was launched"]
    labels = ["animals", "finance", "space"]
    ours = memfit.Classifier(tiny_nli_dir, dtype="fp32", backend="onnxruntime")
    assert ours.runtime.backend.name == "onnxruntime"
    reference = pipeline("zero-shot-classification", model=tiny_nli_dir, device="cpu")
    for multi_label in (False, True):
        for mine, theirs in zip(
            ours.classify(texts, labels, multi_label=multi_label), reference(texts, labels, multi_label=multi_label)
        ):
            assert mine.labels == theirs["labels"]
            np.testing.assert_allclose(mine.scores, theirs["scores"], atol=1e-5, rtol=0)


def test_the_second_load_reads_the_cached_graph_without_exporting(tiny_model_dir, monkeypatch):
    from memfit.engine import onnx_export

    first = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="onnxruntime")
    monkeypatch.setattr(onnx_export, "export_in_child", lambda *args: pytest.fail("the cached graph should be used"))
    second = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="onnxruntime")
    assert not second.runtime.backend.session.exported
    texts = ["a short text", "another one, a little longer than the first"]
    np.testing.assert_array_equal(first.embed(texts), second.embed(texts))
    eager = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch").embed(texts)
    assert cosine_rows(second.embed(texts), eager).min() >= 0.99999


@pytest.mark.slow
def test_a_run_on_the_cached_graph_imports_neither_torch_nor_transformers_and_equals_pytorch(tiny_model_dir, tmp_path):
    """The tokenizer and config are kept beside the exported graph, as beside OpenVINO's (engine/graph_snapshot.py):
    a run that finds them reads them with ``tokenizers`` alone, and its token rows are those of transformers'
    tokenizer and PyTorch's forward in this process, window by window."""
    data = tmp_path / "texts.jsonl"
    texts = ["a short text", LONG_NEWS_TEXT, "", "naïve café, 2024: ÀÉÎ — tokens & offsets!"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    # the session's graphs (the fixture exported this one): the first run writes the snapshot if no test did
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(sharing_graphs(tmp_path / "cache"))}
    imported = []
    for name in ("first", "second"):
        args = ["embed", str(data), "-o", str(tmp_path / name), "--model", tiny_model_dir, "--dtype", "fp32"]
        args += ["--backend", "onnxruntime", "--tokens", "--long", "chunk"]
        imported.append(memfit_imports(args, env))
    assert not {"torch", "transformers"} & set(imported[1])
    got = memfit.read(tmp_path / "second")
    reference = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch").embed_tokens(texts)
    assert len(got.token_ids) == len(reference) and len(reference[1].token_ids) > 128  # several windows
    for ids, offsets, vectors, expected in zip(got.token_ids, got.token_offsets, got.token_embeddings, reference):
        np.testing.assert_array_equal(ids, expected.token_ids)
        np.testing.assert_array_equal(offsets, expected.offsets)
        if len(ids):
            assert cosine_rows(vectors, expected.embeddings).min() >= 0.99999


@pytest.mark.slow
def test_under_auto_a_run_reads_the_snapshot_beside_the_graph_of_the_backend_that_runs(tiny_model_dir, tmp_path):
    """``auto`` looked for the tokenizer and config in its first backend's cache only (OpenVINO's), before its order
    was measured: where ONNX Runtime runs first and only its graph is cached, every run imported transformers."""
    data = tmp_path / "texts.txt"
    data.write_text("a short text\nanother one, a little longer than the first\n")
    cache = sharing_graphs(tmp_path / "cache", runtimes=("onnxruntime",))  # no OpenVINO graph in it
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(cache), "MEMFIT_BACKEND_ORDER": "onnxruntime,openvino"}
    imported = []
    for name in ("first", "second"):
        args = ["embed", str(data), "-o", str(tmp_path / name), "--model", tiny_model_dir, "--dtype", "fp32"]
        imported.append(memfit_imports(args, env))
        assert memfit.read(tmp_path / name).manifest["settings"]["backend"] == "onnxruntime"
    assert not {"torch", "transformers"} & set(imported[1])
    assert not (cache / "openvino").exists()
    np.testing.assert_array_equal(
        memfit.read(tmp_path / "first").embeddings, memfit.read(tmp_path / "second").embeddings
    )


def test_what_it_refuses_and_where_auto_considers_it():
    from memfit.engine.registry import candidate_backends

    cpu = torch.device("cpu")
    assert [kind.name for kind in candidate_backends("onnxruntime", cpu, "fp32", "none")] == ["onnxruntime"]
    assert [kind.name for kind in candidate_backends("auto", cpu, "fp32", "none")] == [
        "openvino",
        "onnxruntime",
        "torch",
    ]
    assert "onnxruntime" not in [kind.name for kind in candidate_backends("auto", cpu, "bf16", "none")]
    with pytest.raises(ConfigError, match="runs on the CPU"):
        candidate_backends("onnxruntime", torch.device("cuda"), "fp32", "none")
    with pytest.raises(ConfigError, match="--quantize int8 runs on --backend openvino or torch"):
        candidate_backends("onnxruntime", cpu, "fp32", "int8")
    with pytest.raises(ConfigError, match="runs fp32 on the CPU, not fp16; add --dtype fp32"):
        candidate_backends("onnxruntime", cpu, "fp16", "none")


def test_dtype_auto_on_onnxruntime_by_name_runs_fp32_where_auto_would_pick_bf16(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """``--backend onnxruntime`` alone (``--dtype auto``) on a CPU with fast bf16 was refused for a bf16 nobody asked
    for; it runs ONNX Runtime's fp32, as the same command does on a CPU without fast bf16."""
    from memfit.engine import models

    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: True)
    texts = ["one short line", "and a second, somewhat longer line of text"]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(texts) + "\n")
    argv = ["embed", str(source), "--model", tiny_model_dir, "--backend", "onnxruntime", "-o", str(tmp_path / "out")]
    assert main(argv) == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["settings"]["backend"], manifest["settings"]["dtype"]) == ("onnxruntime", "fp32")
    eager = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch").embed(texts)
    assert cosine_rows(memfit.read(tmp_path / "out").embeddings, eager).min() >= 0.99999
    # what auto picks where the backend runs it, or where no backend is named, is unchanged
    assert memfit.Encoder(tiny_model_dir, backend="torch").runtime.dtype == "bf16"
    # without the onnx extra the refusal says so, not to add --dtype fp32
    from memfit.engine import onnxruntime_backend

    monkeypatch.setattr(onnxruntime_backend, "onnxruntime_version", lambda: None)
    assert main([*argv[:-1], str(tmp_path / "again")]) == 2
    assert capsys.readouterr().err.endswith("needs onnxruntime (pip install 'memfit[onnx]')\n")


def test_a_reduced_precision_is_refused_in_one_line_before_anything_is_written(tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "one short line"}) + "\n")
    argv = ["embed", str(source), "--model", tiny_model_dir, "--backend", "onnxruntime", "-o", str(tmp_path / "out")]
    assert main([*argv, "--dtype", "bf16"]) == 2
    assert (
        capsys.readouterr().err
        == "memfit: error: --backend onnxruntime runs fp32 on the CPU, not bf16; add --dtype fp32\n"
    )
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--dtype", "fp32"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["settings"]["backend"], manifest["settings"]["dtype"]) == ("onnxruntime", "fp32")
    assert manifest["backend_choice"] == "asked for by name"
