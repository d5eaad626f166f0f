"""Encoders laid out unlike BERT, as tiny random-weight copies, against transformers' own forward and pipeline:

- ModernBERT: rotary positions, which OpenVINO's CPU plugin fuses into layers that memfit cannot safely release
  (``openvino.compiled.UNSAFE_TO_RELEASE_LAYERS``), and a ``classifier_pooling`` field of its own config, which a
  memfit pooled classifier also writes (``models.is_pooled_classifier``);
- DeBERTa-v2 (the usual zero-shot NLI model): no segment embeddings, though its tokenizer makes segment ids, so its
  exported ONNX graph has no ``token_type_ids`` input;
- MPNet and DeBERTa-v2 bucket relative positions through a float logarithm, which a bf16 OpenVINO graph computed in
  bf16 (``tracing.exact_position_buckets``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from typing import Callable

import numpy as np
import pytest
import torch

import memfit
from conftest import NLI_LABELS, _tokenizer, _write_vocab, tiny_modernbert, with_graphs

SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
TEXTS = ["good movie", "i hate this sad film a lot", "the city at night " * 10, "x"]
CANDIDATES = ["politics", "sports", "weather"]


def _save(root, model_class, config) -> str:
    tok = _tokenizer(_write_vocab(root / "vocab.txt"))
    torch.manual_seed(0)
    model_class(config(tok.vocab_size)).eval().save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def modernbert_dirs(tmp_path_factory) -> dict[str, str]:
    """A ModernBERT encoder (``ModernBertModel``) and NLI classifier (conftest.tiny_modernbert)."""
    return {
        "encoder": tiny_modernbert(tmp_path_factory.mktemp("modernbert")),
        "nli": tiny_modernbert(tmp_path_factory.mktemp("modernbert-nli"), nli=True),
    }


@pytest.fixture(scope="module")
def deberta_nli_dir(tmp_path_factory) -> str:
    """A DeBERTa-v2 NLI classifier with relative attention, as DeBERTa-v3's configs set it."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    def config(vocab_size: int):
        return DebertaV2Config(
            vocab_size=vocab_size,
            **SHAPE,
            max_position_embeddings=128,
            relative_attention=True,
            position_buckets=32,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            type_vocab_size=0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **NLI_LABELS,
        )

    root = _save(tmp_path_factory.mktemp("deberta-nli"), DebertaV2ForSequenceClassification, config)
    return with_graphs(root, openvino=("logits",), onnxruntime=("logits",))


def _mean_pooled(model_dir: str) -> np.ndarray:
    """transformers' forward of each text alone, mean over its tokens: no padding to get wrong."""
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return np.stack([model(**tok([t], return_tensors="pt")).last_hidden_state[0].mean(0).numpy() for t in TEXTS])


def _zero_shot(model_dir: str) -> list[dict[str, float]]:
    from transformers import pipeline

    classify = pipeline("zero-shot-classification", model=model_dir, device="cpu")
    results = [classify(t, candidate_labels=CANDIDATES, hypothesis_template="This example is {}.") for t in TEXTS]
    return [dict(zip(r["labels"], r["scores"])) for r in results]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the plugin's layers as measured on Linux")
def test_a_modernbert_graph_is_refused_by_openvino_before_it_runs_and_auto_runs_it_on_the_next_backend(
    modernbert_dirs, tmp_path
):
    """Released and run again at the same shape, the plugin's fused rotary layers aborted the process (heap
    corruption) in the calibration's second probe: in a child here, as a user's run would have died. A CPU whose
    plugin did not fuse them would run the graph on OpenVINO: then its vectors are checked instead."""
    model = modernbert_dirs["encoder"]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS) + "\n")
    command = [sys.executable, "-m", "memfit", "embed", str(source), "--model", model, "--dtype", "fp32"]
    env = {**os.environ, "MEMFIT_BACKEND_ORDER": "openvino,torch"}  # no measured choice: OpenVINO is tried first
    reference = _mean_pooled(model)

    asked = subprocess.run(
        [*command, "--backend", "openvino", "-o", str(tmp_path / "ov")], capture_output=True, text=True
    )
    assert asked.returncode in (0, 3), asked.stderr[-2000:]  # not a signal, not a traceback
    if asked.returncode == 0:  # no layer it cannot release on this CPU's plugin
        np.testing.assert_allclose(memfit.read(tmp_path / "ov").embeddings, reference, atol=1e-5)
        return
    assert asked.stderr.strip().splitlines()[-1].startswith("memfit: error: OpenVINO's CPU plugin runs this model's")
    assert "Traceback" not in asked.stderr and not (tmp_path / "ov").exists()
    # recorded beside the cached graph: a later load refuses it before compiling it in the job's own process
    from memfit.engine.openvino import compiled
    from memfit.engine.openvino.cache import graph_file
    from memfit.errors import UnsafeGraphError

    assert compiled.recorded_unsafe_layers(graph_file(model, "last_hidden_state").parent) == ["RoPE"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "compile_graph", lambda *args, **kwargs: pytest.fail("compiled again"))
        with pytest.raises(UnsafeGraphError):
            compiled.load_graph(model, "last_hidden_state", False, "fp32", 1, 1)

    auto = subprocess.run([*command, "-o", str(tmp_path / "auto")], capture_output=True, text=True, env=env)
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "RoPE layers" in auto.stderr and "running it on PyTorch" in auto.stderr
    assert json.loads((tmp_path / "auto" / "manifest.json").read_text())["settings"]["backend"] == "torch"
    np.testing.assert_allclose(memfit.read(tmp_path / "auto").embeddings, reference, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_modernbert_embeds_as_its_transformers_forward(modernbert_dirs, backend):
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    encoder = memfit.Encoder(modernbert_dirs["encoder"], dtype="fp32", backend=backend)
    np.testing.assert_allclose(encoder.embed(TEXTS), _mean_pooled(modernbert_dirs["encoder"]), atol=1e-5)


@pytest.mark.parametrize(
    ("model", "backend"),
    [("modernbert", "torch"), ("modernbert", "onnxruntime"), ("deberta", "onnxruntime"), ("deberta", "openvino")],
)
def test_nli_zero_shot_of_modernbert_and_deberta_equals_the_pipeline(modernbert_dirs, deberta_nli_dir, model, backend):
    """ModernBERT's config has a ``classifier_pooling`` of its own, which was read as the mark of a memfit pooled
    classifier (a missing ``2_Dense/`` head); DeBERTa-v2's exported graph takes no segment ids, which ONNX Runtime was
    handed all the same (an invalid input)."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    model_dir = modernbert_dirs["nli"] if model == "modernbert" else deberta_nli_dir
    classifier = memfit.Classifier(model_dir, dtype="fp32", backend=backend)
    results = classifier.classify(TEXTS, CANDIDATES)
    for got, expected in zip(results, _zero_shot(model_dir)):
        scores = dict(zip(got.labels, got.scores))
        np.testing.assert_allclose([scores[c] for c in CANDIDATES], [expected[c] for c in CANDIDATES], atol=1e-5)


def test_only_a_pooled_classifier_memfit_saved_is_read_as_one(modernbert_dirs, tiny_model_dir, tmp_path):
    """ModernBERT's own ``classifier_pooling`` marks nothing: its encoder is classified in embedding mode; a BERT config
    with the field (as memfit saved pooled classifiers before it wrote ``memfit_pooled_head``) is one."""
    from transformers import AutoConfig

    from memfit.engine.models import is_pooled_classifier
    from memfit.jobs.classify import resolve_mode

    modernbert = AutoConfig.from_pretrained(modernbert_dirs["encoder"])
    assert modernbert.classifier_pooling is not None  # the architecture's own field
    assert not is_pooled_classifier(modernbert) and resolve_mode("auto", modernbert) == "embedding"
    saved_before = AutoConfig.from_pretrained(tiny_model_dir)
    saved_before.classifier_pooling = "mean"
    assert is_pooled_classifier(saved_before) and resolve_mode("auto", saved_before) == "supervised"


@pytest.mark.parametrize("recorded_names", [True, False])
def test_a_snapshot_answers_as_its_full_config_whether_it_is_a_pooled_classifier(
    modernbert_dirs, tiny_model_dir, tmp_path, recorded_names
):
    """A config cached beside a compiled graph (read without transformers) says the same, and a snapshot written
    before it recorded its class's names asks the full config."""
    from transformers import AutoConfig, AutoTokenizer

    from memfit.engine.graph_snapshot import SNAPSHOT_FILE, load_snapshot_config, save_snapshot
    from memfit.engine.models import is_pooled_classifier

    saved_before = AutoConfig.from_pretrained(tiny_model_dir)
    saved_before.classifier_pooling = "mean"
    for name, config, expected in (
        ("modernbert", AutoConfig.from_pretrained(modernbert_dirs["encoder"]), False),
        ("saved-before", saved_before, True),
    ):
        folder = tmp_path / name
        folder.mkdir()
        save_snapshot(folder, AutoTokenizer.from_pretrained(tiny_model_dir), config)
        if not recorded_names:
            facts = json.loads((folder / SNAPSHOT_FILE).read_text())
            del facts["config_class_names"]
            (folder / SNAPSHOT_FILE).write_text(json.dumps(facts))
        snapshot = load_snapshot_config(folder, lambda config=config: config)
        assert is_pooled_classifier(snapshot) is expected, name


def test_a_pooled_classifier_on_modernbert_keeps_its_pooling_apart_from_modernberts_own(modernbert_dirs, tmp_path):
    """ModernBERT's ``classifier_pooling`` takes ``cls`` or ``mean`` only: memfit's max pooling written there failed
    the save; a mean or cls one would have overwritten the model's own setting."""
    from transformers import AutoConfig, AutoModel

    from memfit.engine.pooled_classifier import PooledClassifier, load_sequence_classifier

    encoder = AutoModel.from_pretrained(modernbert_dirs["encoder"])
    own = encoder.config.classifier_pooling
    PooledClassifier(encoder, "max", 2).save_pretrained(tmp_path / "out")
    saved = AutoConfig.from_pretrained(tmp_path / "out")
    assert saved.memfit_pooled_head == {"path": "2_Dense", "pooling": "max"} and saved.classifier_pooling == own
    loaded = load_sequence_classifier(str(tmp_path / "out"), torch.device("cpu"), "fp32")
    assert isinstance(loaded, PooledClassifier) and loaded.pooling == "max"


class _Buckets(torch.nn.Module):
    """Each relative position's bucket in a window of the input's length, as ``buckets`` computes it, out through a
    linear layer: OpenVINO's plugin computes the float operations before a matrix product in the graph's precision
    (after the last one, in fp32), and a model's bucket arithmetic comes before its attention's products."""

    def __init__(self, buckets: Callable[[int], torch.Tensor]):
        super().__init__()
        self.buckets = buckets
        self.identity = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(self.identity.weight)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> types.SimpleNamespace:
        buckets = self.buckets(input_ids.size(1)).float()
        return types.SimpleNamespace(last_hidden_state=self.identity(buckets[..., None]))


def _mpnet_buckets(length: int) -> torch.Tensor:
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    positions = torch.arange(length)
    return MPNetEncoder.relative_position_bucket(positions[None, :] - positions[:, None], num_buckets=32)


def _deberta_buckets(length: int) -> torch.Tensor:
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    states = torch.zeros(1, length, 1)
    return build_relative_position(states, states, bucket_size=256, max_position=512)[0]  # DeBERTa-v3's settings


@pytest.mark.parametrize(
    ("buckets", "length"), [(_mpnet_buckets, 400), (_deberta_buckets, 500)], ids=["mpnet", "deberta-v2"]
)
def test_relative_position_buckets_in_a_bf16_openvino_graph_are_transformers_own(buckets, length, openvino_bf16):
    """Traced as transformers computes them, the bf16 graph put MPNet's distances 16, 32 and 90 and 112 of DeBERTa's
    beyond 128 in another bucket (a bias learnt for other distances, in every layer)."""
    from memfit.engine.openvino.compiled import compile_graph
    from memfit.engine.openvino.conversion import convert

    expected = buckets(length).numpy()  # transformers' own arithmetic, in PyTorch's fp32
    assert expected.max() > 16  # windows long enough to reach the logarithmic buckets
    graph = convert(_Buckets(buckets).eval(), "last_hidden_state", with_token_types=False)
    compiled = compile_graph(graph, ("input_ids", "attention_mask"), "bf16", 1, 1, "converted")
    ones = np.ones((1, length), dtype=np.int64)
    got = compiled.compiled({"input_ids": ones, "attention_mask": ones})[0][..., 0]
    np.testing.assert_array_equal(got, expected)
