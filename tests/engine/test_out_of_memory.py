"""The out-of-memory guard: injected failures above a size change nothing in the output, lose or repeat
no window, and keep the order; other errors propagate; a lone window that fails names its text."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import memfit
from memfit.data.chunking import Window
from memfit.engine.batches import AdaptiveBudget, SequenceDoesNotFit, is_out_of_memory, run_windows
from memfit.memory.planner import BatchBudget, padded_length

CPU = torch.device("cpu")
CPU_ALLOCATOR_FAILURE = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"
)


def _windows(lengths: list[int]) -> list[Window]:
    return [
        Window(item=i, index=0, input_ids=np.arange(n, dtype=np.int64) + i, token_type_ids=None, own_start=0, own_end=n)
        for i, n in enumerate(lengths)
    ]


class FailingEngine:
    """Results are a pure function of each window; a batch over ``fail_above`` padded tokens raises."""

    def __init__(self, fail_above: float = float("inf"), error: type[BaseException] = torch.OutOfMemoryError):
        self.fail_above = fail_above
        self.error = error
        self.completed: list[int] = []  # window items, once per successful run
        self.failures = 0

    def forward(self, windows):
        padded = len(windows) * padded_length(max(len(w) for w in windows))
        if padded > self.fail_above:
            self.failures += 1
            raise self.error(CPU_ALLOCATOR_FAILURE if self.error is RuntimeError else "CUDA out of memory")
        self.completed.extend(w.item for w in windows)
        return [int(w.input_ids.sum()) * 7 + len(w) for w in windows]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError, MemoryError])
@pytest.mark.parametrize("seed", range(4))
def test_failures_above_a_size_leave_the_output_unchanged(error, seed):
    rng = random.Random(seed)
    windows = _windows([rng.randint(1, 120) for _ in range(300)])
    reference = [int(w.input_ids.sum()) * 7 + len(w) for w in windows]  # FailingEngine's value, by hand

    engine = FailingEngine(fail_above=rng.choice([300, 700, 1500]), error=error)
    budget = AdaptiveBudget(BatchBudget(4096))
    results = run_windows(engine, windows, budget, CPU)

    assert results == reference  # same values, in window order
    assert sorted(engine.completed) == list(range(len(windows)))  # every window ran exactly once
    assert engine.failures > 0 and budget.oom_events > 0 and budget.factor < 1


def test_the_budget_regrows_after_successes():
    budget = AdaptiveBudget(BatchBudget(1000), successes_before_regrow=2)
    budget.record_oom()
    assert budget.current.max_batch_tokens == 500
    for _ in range(2 * 4):
        budget.record_success()
    assert budget.factor == 1.0 and budget.current == budget.base


@pytest.mark.parametrize(
    "error", [ValueError("bad input"), RuntimeError("shape mismatch in matmul"), KeyError("input_ids")]
)
def test_non_memory_errors_propagate(error):
    class Broken:
        def forward(self, windows):
            raise error

    with pytest.raises(type(error)):
        run_windows(Broken(), _windows([10, 20, 30]), AdaptiveBudget(BatchBudget(4096)), CPU)


def test_real_allocator_failures_count_as_out_of_memory():
    with pytest.raises(RuntimeError) as cpu_failure:
        torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator refuses it
    assert is_out_of_memory(cpu_failure.value)
    with pytest.raises(MemoryError) as numpy_failure:
        np.empty(2**62, dtype=np.uint8)
    assert is_out_of_memory(numpy_failure.value)
    assert not is_out_of_memory(RuntimeError("Expected all tensors to be on the same device"))


def test_a_lone_window_that_fails_is_reported():
    engine = FailingEngine(fail_above=64)
    with pytest.raises(SequenceDoesNotFit) as failure:
        run_windows(engine, _windows([10, 100, 20]), AdaptiveBudget(BatchBudget(4096)), CPU)
    assert failure.value.window.item == 1


@pytest.fixture(scope="module", params=["torch", "openvino"])
def tiny(tiny_model_dir, tmp_path_factory, request):
    import os

    os.environ.setdefault("MEMFIT_CACHE_DIR", str(tmp_path_factory.mktemp("memfit-cache")))
    return memfit.Encoder(tiny_model_dir, dtype="fp32", backend=request.param)


def _fail_model_above(monkeypatch, encoder: memfit.Encoder, max_tokens: int) -> list[int]:
    """Make the real model (PyTorch's forward, or the compiled graph's inference) raise the CPU allocator's error
    on inputs over ``max_tokens`` padded tokens."""
    from memfit.engine.openvino.compiled import CompiledGraph

    sizes: list[int] = []

    def check(input_ids) -> None:
        sizes.append(int(np.prod(input_ids.shape)))
        if sizes[-1] > max_tokens:
            raise RuntimeError(CPU_ALLOCATOR_FAILURE)

    if encoder.runtime.backend.name == "openvino":
        infer = CompiledGraph.infer

        def failing_infer(graph, inputs):
            check(inputs["input_ids"])
            return infer(graph, inputs)

        monkeypatch.setattr(CompiledGraph, "infer", failing_infer)
        return sizes
    forward = encoder.model.forward

    def failing_forward(input_ids, **kwargs):
        check(input_ids)
        return forward(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(encoder.model, "forward", failing_forward)
    return sizes


def test_injected_failures_in_the_real_engine_leave_embeddings_unchanged(tiny, monkeypatch):
    rng = random.Random(0)
    texts = [
        " ".join(
            rng.choice(["the cat", "a long sentence about space", "hello", "dogs and cats"])
            for _ in range(rng.randint(1, 60))
        )
        for _ in range(60)
    ]
    monkeypatch.setattr(tiny, "budget", AdaptiveBudget(BatchBudget(4096)))
    reference = tiny.embed(texts)
    tokens = tiny.embed_tokens(texts)

    sizes = _fail_model_above(monkeypatch, tiny, 600)
    monkeypatch.setattr(tiny, "budget", AdaptiveBudget(BatchBudget(4096)))
    failed = tiny.embed(texts)
    failed_tokens = tiny.embed_tokens(texts)

    assert max(sizes) > 600 and tiny.budget.oom_events > 0  # failures really happened
    # batches are composed differently (other padding), so equal up to float rounding
    np.testing.assert_allclose(failed, reference, rtol=1e-5, atol=1e-6)
    assert [len(t.token_ids) for t in failed_tokens] == [len(t.token_ids) for t in tokens]
    for ours, ref in zip(failed_tokens, tokens):
        np.testing.assert_array_equal(ours.token_ids, ref.token_ids)
        np.testing.assert_allclose(ours.embeddings, ref.embeddings, rtol=1e-5, atol=1e-5)


def test_a_text_that_fails_alone_stops_with_its_id_and_the_ways_out(tiny, monkeypatch, tmp_path):
    texts = ["short text", "another short one", " ".join(["a long sentence about space"] * 30), "tail"]
    _fail_model_above(monkeypatch, tiny, 64)
    with pytest.raises(memfit.DoesNotFitError) as failure:
        tiny.embed(texts, long="truncate")
    message = str(failure.value)
    assert "id=2" in message
    for way_out in ("--max-length", "--long chunk", "--dtype", "--memory-budget"):
        assert way_out in message
