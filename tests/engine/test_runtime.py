"""One runtime, many jobs: a model loaded once by ``memfit.load_runtime`` and shared by jobs and threads.

Reference: a plain transformers forward with mask-aware mean pooling, truncated to the runtime's window
(what memfit's ``long="truncate"`` computes), on the tiny random-weight test model.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from reference_outputs import fp32_reference  # a plain transformers fp32 forward, mean-pooled, truncated

import memfit
from conftest import sharing_graphs

TEXTS = [f"the cat {i} sat on the mat{' and looked at the dog' * (i % 7)}" for i in range(24)]


@pytest.fixture(scope="module")
def calibration_cache(tmp_path_factory) -> Path:
    """A calibration cache of this module's own, empty when the runtime is loaded (but for the session's graphs)."""
    return sharing_graphs(tmp_path_factory.mktemp("runtime-calibration-cache"))


@pytest.fixture(scope="module")
def runtime(tiny_model_dir, calibration_cache) -> memfit.Runtime:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMFIT_CACHE_DIR", str(calibration_cache))
        return memfit.load_runtime(tiny_model_dir, device="cpu", dtype="fp32", memory_budget="4GiB")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU's peak is read from /proc")
def test_runtime_is_frozen_and_carries_its_plan(runtime, calibration_cache):
    assert runtime.task == "embedding" and runtime.device.type == "cpu" and runtime.dtype == "fp32"
    assert runtime.memory.budget_bytes == 4 * 2**30 and runtime.memory.batch_budget.max_batch_tokens > 0
    # with nothing cached, the memory model is measured (the probes; not the analytic fallback), and the
    # measurement the runtime plans with is the one it cached for the next process
    assert runtime.calibration.source == "probes"
    [cached] = calibration_cache.glob("calibration-*.json")
    assert json.loads(cached.read_text())["calibration"] == dataclasses.asdict(runtime.calibration.calibration)
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.max_length = 16  # type: ignore[misc]


def test_jobs_on_one_runtime_from_several_threads_match_a_plain_forward(tiny_model_dir, runtime):
    reference = fp32_reference(tiny_model_dir, TEXTS, runtime.max_length)
    encoders = [memfit.Encoder(runtime=runtime) for _ in range(3)]
    assert all(e.model is runtime.model for e in encoders)  # loaded once
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda e: e.embed(TEXTS, pooling="mean", long="truncate"), encoders))
    for vectors in results:
        np.testing.assert_allclose(vectors, reference, atol=1e-5)


def test_a_classifier_runs_on_the_same_runtime(tiny_model_dir, runtime):
    clf = memfit.Classifier(runtime=runtime)
    assert clf.mode == "embedding" and clf.encoder.model is runtime.model
    labels = ["cats", "dogs"]
    results = clf.classify(TEXTS[:4], labels, template="{}")
    # the scores are the softmax over the labels of cosine / temperature, from the same plain vectors
    vectors = fp32_reference(tiny_model_dir, TEXTS[:4] + labels, runtime.max_length)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    logits = unit[:4] @ unit[4:].T / clf.temperature
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    for result, row in zip(results, expected):
        got = dict(zip(result.labels, result.scores))
        np.testing.assert_allclose([got[label] for label in labels], row, atol=1e-4)
    with pytest.raises(memfit.ConfigError, match="no entailment class"):
        memfit.Classifier(mode="nli", runtime=runtime)
