"""The batch planner as a pure function of integers: property tests plus a few worked examples."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.memory.planner import BatchBudget, plan_batches

lengths_st = st.lists(st.integers(min_value=1, max_value=600), min_size=0, max_size=200)
budget_st = st.builds(
    BatchBudget,
    max_batch_tokens=st.integers(min_value=1, max_value=20_000),
    max_batch_seqs=st.integers(min_value=1, max_value=64),
    max_attention_cells=st.one_of(st.none(), st.integers(min_value=1, max_value=2_000_000)),
)


def _width(batch: list[int], lengths: list[int]) -> int:
    """Padded length of a batch: its longest sequence rounded up to a multiple of 8 (the padding the
    engine applies), computed here from the definition rather than with the planner's helper."""
    return math.ceil(max(lengths[i] for i in batch) / 8) * 8


def _cost_ok(batch: list[int], lengths: list[int], budget: BatchBudget) -> bool:
    n, width = len(batch), _width(batch, lengths)
    cells_ok = budget.max_attention_cells is None or n * width * width <= budget.max_attention_cells
    return n <= budget.max_batch_seqs and n * width <= budget.max_batch_tokens and cells_ok


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=budget_st)
def test_every_index_exactly_once(lengths, budget):
    batches = plan_batches(lengths, budget)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(batches), "no empty batch"


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=budget_st)
def test_no_batch_over_budget_except_a_lone_oversized_sequence(lengths, budget):
    for batch in plan_batches(lengths, budget):
        # a batch over budget is allowed only as one sequence that exceeds the budget on its own
        assert _cost_ok(batch, lengths, budget) or (len(batch) == 1 and not _cost_ok(batch, lengths, budget))


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=budget_st)
def test_oversized_sequence_gets_its_own_batch(lengths, budget):
    for batch in plan_batches(lengths, budget):
        if any(not _cost_ok([i], lengths, budget) for i in batch):
            assert len(batch) == 1


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=budget_st)
def test_sorted_batches_are_contiguous_runs_of_lengths(lengths, budget):
    """Why the plan pads little: each batch holds neighbours in length order, longest batch first,
    so a short sequence never shares a batch with one longer than the next batch's longest."""
    batches = plan_batches(lengths, budget)
    for earlier, later in zip(batches, batches[1:]):
        assert min(lengths[i] for i in earlier) >= max(lengths[i] for i in later)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=budget_st)
def test_batches_close_only_when_the_next_sequence_does_not_fit(lengths, budget):
    """Greedy maximality: no two consecutive batches could have shared the first one's width."""
    batches = plan_batches(lengths, budget)
    for earlier, later in zip(batches, batches[1:]):
        assert not _cost_ok(earlier + later[:1], lengths, budget)


def test_examples_mixed_lengths_are_grouped_by_length():
    lengths = [8, 100, 9, 101, 7, 99]
    budget = BatchBudget(max_batch_tokens=3 * 104, max_batch_seqs=16)
    assert plan_batches(lengths, budget) == [[3, 1, 5], [2, 0, 4]]


def test_examples_budget_in_padded_tokens():
    # 10 tokens pad to 16: four of them cost 64 padded tokens, a fifth would cost 80
    assert plan_batches([10] * 5, BatchBudget(max_batch_tokens=64)) == [[0, 1, 2, 3], [4]]
    assert plan_batches([10] * 5, BatchBudget(max_batch_tokens=64, max_batch_seqs=2)) == [[0, 1], [2, 3], [4]]


def test_examples_attention_cells_cap_long_batches():
    # 64 x 64 = 4096 cells per sequence: a cap of 10,000 cells allows two at a time
    budget = BatchBudget(max_batch_tokens=10**6, max_attention_cells=10_000)
    assert plan_batches([64, 64, 64], budget) == [[0, 1], [2]]


def test_examples_oversized_and_empty():
    assert plan_batches([1000, 5], BatchBudget(max_batch_tokens=100)) == [[0], [1]]
    assert plan_batches([], BatchBudget(max_batch_tokens=100)) == []


def test_budget_refuses_nothing_at_all():
    with pytest.raises(ValueError):
        BatchBudget(max_batch_tokens=0)


# -- the server's run selection (serve/batcher.py) on the same budget ---------------------------------------------

queue_st = st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=12)


def _fitting_runs(lengths: list[int], budget: BatchBudget) -> list[list[int]]:
    """Every run of neighbours in (length, index) order that fits ``budget``, or is one window on its own: the
    candidates :func:`best_run` chooses among, listed by brute force."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    runs = []
    for lo in range(len(order)):
        for hi in range(lo, len(order)):
            run = order[lo : hi + 1]
            if len(run) == 1 or _cost_ok(run, lengths, budget):
                runs.append(run)
    return runs


@settings(max_examples=300, deadline=None)
@given(lengths=queue_st, budget=budget_st, data=st.data())
def test_serve_runs_fit_and_carry_the_most_real_tokens_of_any_fitting_run(lengths, budget, data):
    from memfit.serve.batcher import best_run

    anchor = data.draw(st.one_of(st.none(), st.integers(min_value=0, max_value=len(lengths) - 1)))
    chosen = best_run(lengths, budget, anchor=anchor)
    assert chosen and len(set(chosen)) == len(chosen)
    assert len(chosen) == 1 or _cost_ok(chosen, lengths, budget)
    candidates = [run for run in _fitting_runs(lengths, budget) if anchor is None or anchor in run]
    assert sorted(chosen) in [sorted(run) for run in candidates]
    assert sum(lengths[i] for i in chosen) == max(sum(lengths[i] for i in run) for run in candidates)


@settings(max_examples=300, deadline=None)
@given(lengths=queue_st, budget=budget_st, data=st.data())
def test_serve_takes_an_overdue_request_whole_when_it_fits(lengths, budget, data):
    from memfit.serve.batcher import best_run, whole_request_run

    request = data.draw(st.lists(st.sampled_from(range(len(lengths))), min_size=1, unique=True))
    chosen = whole_request_run(lengths, request, budget)
    assert len(set(chosen)) == len(chosen) and request[0] in chosen
    if len(request) == 1 or _cost_ok(request, lengths, budget):
        assert chosen[: len(request)] == request  # every window of the request, in one batch
        assert len(chosen) == 1 or _cost_ok(chosen, lengths, budget)
        assert _width(chosen, lengths) == _width(request, lengths)  # topped up only with what pads no wider
        others = [
            i for i in range(len(lengths)) if i not in request and _width([i], lengths) <= _width(request, lengths)
        ]
        room = len(chosen) - len(request)
        longest = sorted((lengths[i] for i in others), reverse=True)[:room]
        assert sorted((lengths[i] for i in chosen[len(request) :]), reverse=True) == longest
        assert room == len(others) or not _cost_ok(
            chosen + [next(i for i in others if i not in chosen)], lengths, budget
        )
    else:
        assert chosen == best_run(lengths, budget, anchor=request[0])
