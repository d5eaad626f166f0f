"""fp32 linear layers on oneDNN (engine/cpu_linears.py): the same numbers as PyTorch's default, on the resident and
the streamed paths, whichever way this CPU's measurement goes (the tests force each way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModel, AutoTokenizer

from memfit.engine import cpu_linears
from memfit.engine.cpu_linears import ONEDNN_LINEARS, OneDNNLinear, use_onednn_linears
from memfit.engine.runtime import load_runtime
from memfit.jobs.encoder import Encoder
from reference_outputs import row_cosines

pytestmark = pytest.mark.skipif(not cpu_linears._onednn_available(), reason="this PyTorch has no oneDNN linear")

TEXTS = [
    "a short one",
    "the movie was long, and its second half dragged on far past the point where anyone cared",
    "good",
    "the acting was fine but the plot made no sense at all, and the ending was worse than the rest of it",
]


@pytest.fixture
def onednn_measured_faster(monkeypatch):
    """This CPU's measurement replaced by a clear win, so the oneDNN path runs on every CPU the suite runs on."""
    monkeypatch.setattr(cpu_linears, "onednn_speedup", lambda in_features, out_features: 2.0)


@pytest.fixture(scope="module")
def biased_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny BERT with random biases in its linear layers (transformers initializes them to zero, and a product
    that lost its bias would pass), saved with its tokenizer."""
    root = tmp_path_factory.mktemp("tiny-bert-biased")
    model = AutoModel.from_pretrained(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for linear in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=generator) * 0.5)
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(root)
    return str(root)


class _RecordedOps(TorchDispatchMode):
    """The operators that run inside the block, by name: which kernel a layer's product went to."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _plain_forward(model_dir: str) -> np.ndarray:
    """Mean-pooled vectors of a plain transformers forward, one text at a time: the independent reference."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    rows = []
    for text in TEXTS:
        with torch.no_grad():
            rows.append(model(**tok(text, return_tensors="pt")).last_hidden_state[0].mean(0).numpy())
    return np.stack(rows)


def test_a_switched_layer_keeps_its_parameters_and_equals_the_default_product_in_and_out_of_autograd():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    reference = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    reference.load_state_dict(model.state_dict())
    parameters = [id(p) for p in model.parameters()]
    x = torch.randn(3, 7, 64)
    with torch.inference_mode():
        expected = reference(x)
    cpu_linears._measured_speedup.cache_clear()
    assert cpu_linears.onednn_speedup(96, 64) > 0  # the same numbers, whatever the speed
    for linear in (model[0], model[2]):
        linear.__class__ = OneDNNLinear
    assert [id(p) for p in model.parameters()] == parameters
    with torch.inference_mode(), _RecordedOps() as ops:
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert "mkldnn._linear_pointwise.default" in ops.names and "aten.linear.default" not in ops.names
    strided = torch.randn(64)[::2]  # a bias the operator would misread: F.linear's product instead
    model[2].bias, reference[2].bias = torch.nn.Parameter(strided), torch.nn.Parameter(strided.clone())
    with torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    model(x).sum().backward()  # under autograd, F.linear: gradients flow
    assert model[0].weight.grad is not None and x.grad is not None


def test_only_fp32_cpu_linears_switch_and_only_where_oneDNN_is_clearly_faster(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.ReLU())
    monkeypatch.setattr(cpu_linears, "onednn_speedup", lambda in_features, out_features: 1.1)
    assert not use_onednn_linears(model)
    assert type(model[0]) is torch.nn.Linear
    monkeypatch.setattr(cpu_linears, "onednn_speedup", lambda in_features, out_features: 1.5)
    assert use_onednn_linears(model)
    assert type(model[0]) is OneDNNLinear and type(model[1]) is torch.nn.Linear


def test_the_pytorch_backend_on_oneDNN_equals_a_plain_transformers_forward(biased_model_dir, onednn_measured_faster):
    runtime = load_runtime(biased_model_dir, device="cpu", dtype="fp32", backend="torch", calibrate=False)
    assert runtime.backend.network.runtime.endswith(ONEDNN_LINEARS)  # a calibration of the default is not reused
    assert any(isinstance(m, OneDNNLinear) for m in runtime.backend.module.modules())
    with _RecordedOps() as ops:
        got = Encoder(runtime=runtime).embed(TEXTS, pooling="mean")
    assert "mkldnn._linear_pointwise.default" in ops.names
    assert row_cosines(got, _plain_forward(biased_model_dir)).min() >= 0.99999


def test_the_streamed_path_on_oneDNN_equals_a_plain_transformers_forward(biased_model_dir, onednn_measured_faster):
    """Each layer's weights are assigned to the one switched slot in turn: every layer runs on oneDNN."""
    runtime = load_runtime(biased_model_dir, device="cpu", dtype="fp32", offload="always", calibrate=False)
    assert runtime.backend.name == "streamed"
    assert runtime.backend.network.runtime.endswith(ONEDNN_LINEARS)
    assert all(type(m) is not torch.nn.Linear for m in runtime.backend.skeleton.slot.modules())
    with _RecordedOps() as ops:
        got = Encoder(runtime=runtime).embed(TEXTS, pooling="mean")
    assert "mkldnn._linear_pointwise.default" in ops.names
    assert row_cosines(got, _plain_forward(biased_model_dir)).min() >= 0.99999


def test_autocast_keeps_its_casts():
    """Under autocast (bf16 training, a user's own loop) the layer leaves the casting to autocast, as ``F.linear``
    does: its output is autocast's dtype, not fp32."""
    model = torch.nn.Linear(48, 16)
    model.__class__ = OneDNNLinear
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(4, 48)).dtype is torch.bfloat16
