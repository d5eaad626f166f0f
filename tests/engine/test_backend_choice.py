"""``--backend auto`` between OpenVINO and ONNX Runtime: measured once per CPU in a child process, kept in the cache,
and said in ``memfit plan`` and the manifest. Each test has a cache of its own for the verdict (its compiled graphs are
the session's: these tests are about the choice, not the conversion), and clears the order the suite pins
(tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

import memfit
from memfit.cli import main
from memfit.engine import backend_choice
from memfit.engine.backend_choice import MARGIN, order_of
from memfit.engine.registry import BACKENDS
from memfit.engine.precision import cosine_rows

from conftest import sharing_graphs

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

NAMES = ["openvino", "onnxruntime", "torch"]


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    cache = sharing_graphs(tmp_path / "cache")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(cache))
    monkeypatch.delenv(backend_choice.ORDER_VARIABLE, raising=False)
    return cache


@pytest.mark.parametrize(
    "rates, first",
    [
        ({"openvino": 100.0, "onnxruntime": 100.0 * MARGIN * 1.01}, "onnxruntime"),  # faster by more than the margin
        ({"openvino": 100.0, "onnxruntime": 100.0 * MARGIN * 0.99}, "openvino"),  # within it: auto's order stands
        ({"openvino": 100.0, "onnxruntime": 50.0}, "openvino"),
        ({"openvino": None, "onnxruntime": 50.0}, "onnxruntime"),  # the one that did not load goes last
        ({"openvino": None, "onnxruntime": None}, "openvino"),
    ],
)
def test_a_later_runtime_goes_first_only_when_faster_by_the_margin(rates, first):
    order = order_of(NAMES[:2], rates)
    assert order[0] == first and sorted(order) == sorted(NAMES[:2])


def test_auto_in_fp32_measures_once_runs_the_faster_and_says_why(tiny_model_dir, own_cache, tmp_path, monkeypatch):
    source = tmp_path / "in.jsonl"
    texts = ["one short line", "and another, a little longer than the first one"]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["embed", str(source), "--model", tiny_model_dir, "--dtype", "fp32", "-o", str(tmp_path / "a")]) == 0
    (verdict_file,) = (own_cache / "backend-choice").glob("*.json")
    verdict = json.loads(verdict_file.read_text())["verdict"]
    rates = verdict["tokens_per_s"]
    assert set(rates) == {"openvino", "onnxruntime"} and all(rate > 0 for rate in rates.values()), rates
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    ran = manifest["settings"]["backend"]
    assert ran == verdict["order"][0]
    assert manifest["backend_choice"].startswith("auto: the fastest measured on this CPU (tokens/s: ")
    # the second run reads the verdict: no probe
    monkeypatch.setattr(backend_choice, "_measure", lambda *args: pytest.fail("the cached verdict should be used"))
    second = memfit.Encoder(tiny_model_dir, dtype="fp32")
    assert second.runtime.backend.name == ran
    reference = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch").embed(texts)
    assert cosine_rows(second.embed(texts), reference).min() >= 0.99999
    report = memfit.plan(tiny_model_dir, dtype="fp32")
    assert report.backend == ran and report.backend_choice == manifest["backend_choice"]


def test_nothing_is_measured_where_only_one_runtime_can_run_the_request(tiny_model_dir, own_cache, monkeypatch):
    monkeypatch.setattr(backend_choice, "_measure", lambda *args: pytest.fail("nothing to measure"))
    encoder = memfit.Encoder(tiny_model_dir, dtype="bf16")  # ONNX Runtime runs fp32 only
    assert encoder.runtime.backend.name == "openvino"
    assert encoder.runtime.backend_choice == "auto: the first backend that runs this request"
    assert not (own_cache / "backend-choice").exists()


def test_the_order_variable_sets_the_order_without_measuring(tiny_model_dir, own_cache, monkeypatch):
    monkeypatch.setattr(backend_choice, "_measure", lambda *args: pytest.fail("the variable's order should be used"))
    monkeypatch.setenv(backend_choice.ORDER_VARIABLE, "onnxruntime,openvino")
    encoder = memfit.Encoder(tiny_model_dir, dtype="fp32")
    assert encoder.runtime.backend.name == "onnxruntime"
    assert "MEMFIT_BACKEND_ORDER" in encoder.runtime.backend_choice


def test_a_verdict_where_a_runtime_could_not_load_the_model_holds_for_that_model_alone(own_cache, monkeypatch):
    """OpenVINO refuses some graphs (ModernBERT's): that probe measured the model, not the CPU, so the next model
    on this CPU is measured again, and the model itself is not."""
    probed = []

    def probe(measured, model_name, *args):
        probed.append(model_name)
        rates = {"openvino": None if model_name == "refused-by-openvino" else 200.0, "onnxruntime": 100.0}
        return backend_choice.Verdict(rates, order_of([kind.name for kind in measured], rates), model_name)

    def first(model: str) -> str:
        kinds = [BACKENDS[name] for name in NAMES]
        return backend_choice.ordered_by_measurement(kinds, model, "embed", "fp32", "none")[0][0].name

    monkeypatch.setattr(backend_choice, "_measure", probe)
    assert first("refused-by-openvino") == "onnxruntime"
    assert first("refused-by-openvino") == "onnxruntime" and probed == ["refused-by-openvino"]  # kept for it
    assert first("another-model") == "openvino" and probed == ["refused-by-openvino", "another-model"]
    assert first("a-third-model") == "openvino" and len(probed) == 2  # a full verdict holds for the CPU
