"""The closed-loop guard (``memory/guard.py``): each batch is cut to the room the resident set leaves now.

The cut logic is driven by a scripted process (a fake resident-set reader) and checked against
arithmetic done here; then the guard is run inside ``run_windows`` with a fake engine (order kept, each
window once, no batch larger than admitted); and in a real process, where ballast allocated after the
plan leaves room for only a few windows: the batches shrink, the kernel's ``VmHWM`` stays under the
budget, and when not even one window fits the run stops with the budget that would work.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from memfit.data.chunking import Window
from memfit.engine.batches import AdaptiveBudget, run_windows
from memfit.data.sources import Record
from memfit.errors import DoesNotFitError
from memfit.io.sinks import BackgroundWriter
from memfit.jobs.runner import PreparedBlock, run_job
from memfit.memory.guard import ResidentSetGuard
from memfit.memory.host_budget import BlockLimits
from memfit.memory.model import ActivationModel
from memfit.memory.peak import clean_library_mappings
from memfit.memory.planner import BatchBudget
from reference_outputs import fp32_reference

MiB = 2**20
PER_TOKEN = ActivationModel(bytes_per_token=1024.0, bytes_per_attention_cell=0.0)  # 1 MiB per 1,024 tokens


class ScriptedProcess:
    """A process whose resident set, file pages and high-water mark the test sets; records trims: the heap's
    alone (``heap_trims``, taking ``freed_heap`` off the resident set) and the release's (``trims``)."""

    def __init__(self, resident: int, file_pages: int = 0):
        self.resident = resident
        self.file_pages = file_pages  # the part of the resident set that is file pages
        self.peak = resident
        self.trims = 0
        self.resident_after_trim: int | None = None
        self.file_pages_trimmed = 0  # clean file pages the trim hands back
        self.heap_trims = 0
        self.freed_heap = 0  # freed heap the allocator keeps, in the resident set until a trim hands it back

    def read_resident(self) -> int:
        return self.resident

    def read_peak(self) -> int:
        return self.peak

    def read_file_resident(self) -> int:
        return self.file_pages

    def trim(self) -> None:
        self.trims += 1
        if self.resident_after_trim is not None:
            self.resident = self.resident_after_trim
        self.resident -= self.file_pages_trimmed
        self.file_pages -= self.file_pages_trimmed

    def trim_heap(self) -> None:
        self.heap_trims += 1
        self.resident -= self.freed_heap
        self.freed_heap = 0

    def fault_back(self, file_bytes: int) -> None:
        self.resident += file_bytes
        self.file_pages += file_bytes
        self.peak = max(self.peak, self.resident)


def _guard(process: ScriptedProcess, budget: int, **kwargs) -> ResidentSetGuard:
    return ResidentSetGuard(
        budget,
        PER_TOKEN,
        read_resident=process.read_resident,
        read_peak=process.read_peak,
        trim=process.trim,
        trim_heap=process.trim_heap,
        read_file_resident=process.read_file_resident,
        **kwargs,
    )


def test_a_batch_that_fits_beside_the_resident_set_runs_whole():
    process = ScriptedProcess(resident=500 * MiB)
    guard = _guard(process, budget=600 * MiB, concurrent_bytes=20 * MiB, margin_bytes=8 * MiB)
    admitted = guard.admit(8, 1024)  # 8 MiB of activations; 600 - 500 - 20 - 8 = 72 MiB of room
    assert admitted.batch_size == 8 and guard.batches_cut == 0


def test_drift_cuts_the_batch_to_what_the_room_holds_now():
    process = ScriptedProcess(resident=500 * MiB)
    guard = _guard(process, budget=600 * MiB, concurrent_bytes=20 * MiB, margin_bytes=8 * MiB)
    process.resident = 567 * MiB  # 67 MiB drifted in: 600 - 567 - 20 - 8 = 5 MiB of room, 1 MiB a sequence
    admitted = guard.admit(8, 1024)
    assert admitted.batch_size == 5 and guard.batches_cut == 1
    guard.done(admitted)
    process.resident = 567 * MiB + 512 * 1024  # half a MiB more: only 4 fit now
    assert guard.admit(8, 1024).batch_size == 4


def test_before_a_cut_the_freed_heap_is_handed_back_once_per_batch_run():
    process = ScriptedProcess(resident=560 * MiB)
    guard = _guard(process, budget=600 * MiB, concurrent_bytes=20 * MiB, margin_bytes=8 * MiB)
    first = guard.admit(8, 1024)  # 600 - 560 - 28 = 12 MiB of room: the whole batch, and no trim
    assert first.batch_size == 8 and process.heap_trims == 0
    guard.done(first)
    # the batch's 8 MiB were freed, but the allocator kept them: read as they are, only 4 of 8 fit
    process.resident += 8 * MiB
    process.freed_heap = 8 * MiB
    second = guard.admit(8, 1024)
    assert second.batch_size == 8 and process.heap_trims == 1 and guard.batches_cut == 0
    # no batch has ended since: a batch admitted beside the running one is cut without another trim (the heap
    # it would hand back, 3 MiB, is no room the running batch does not hold) and nothing is released
    process.resident += 3 * MiB
    process.freed_heap = 3 * MiB
    third = guard.admit(8, 1024)  # 600 - 563 - 28 - 8 running = 1 MiB
    assert third.batch_size == 1 and process.heap_trims == 1 and process.trims == 0 and guard.batches_cut == 1
    guard.done(second)
    guard.done(third)
    process.resident += 5 * MiB  # both ended, and the allocator keeps 8 MiB of what they freed
    process.freed_heap = 8 * MiB
    assert guard.admit(8, 1024).batch_size == 8 and process.heap_trims == 2


def test_before_a_cut_the_buffers_the_network_keeps_for_the_next_batch_are_released_with_the_heap():
    """A compiled network keeps the buffers of its largest batch (OpenVINO: until released); counted as held beside the
    next batch's own prediction of them, they cut it, or refused it outright in a real 600 MiB run. Released where
    the heap's trim left the batch cut, once per batch run, they make the room again."""
    process = ScriptedProcess(resident=500 * MiB)
    kept = []

    def release_kept() -> None:
        kept.append(process.resident)
        process.resident -= 60 * MiB if process.resident >= 560 * MiB else 0

    guard = _guard(
        process, budget=600 * MiB, concurrent_bytes=20 * MiB, margin_bytes=8 * MiB, release_kept=[release_kept]
    )
    first = guard.admit(60, 1024)  # 600 - 500 - 28 = 72 MiB of room: 60 sequences of 1 MiB, whole, nothing released
    assert first.batch_size == 60 and kept == []
    guard.done(first)
    process.resident += 60 * MiB  # the network keeps the batch's buffers: 12 MiB of room, read as it is
    second = guard.admit(60, 1024)
    # the heap's trim first (nothing freed there), then the kept buffers and a second trim
    assert second.batch_size == 60 and kept == [560 * MiB] and process.heap_trims == 2 and guard.batches_cut == 0
    # beside a running batch (a server's other model worker) what the network keeps is in use: not released
    third = guard.admit(10, 1024)  # 600 - 500 - 28 - 60 running = 12 MiB: whole
    guard.done(third)
    process.resident += 10 * MiB  # its buffers, kept
    fourth = guard.admit(60, 1024)  # 600 - 510 - 28 - 60 running = 2 MiB
    assert fourth.batch_size == 2 and len(kept) == 1 and process.heap_trims == 3
    guard.done(second)
    guard.done(fourth)
    assert process.trims == 0  # nothing was released for a refusal


def test_batches_running_side_by_side_count_against_each_other():
    process = ScriptedProcess(resident=500 * MiB)
    guard = _guard(process, budget=520 * MiB, margin_bytes=0)
    first = guard.admit(12, 1024)  # 12 of the 20 MiB
    second = guard.admit(12, 1024)  # the first is still running: 8 MiB left
    assert (first.batch_size, second.batch_size) == (12, 8)
    guard.done(first)
    assert guard.admit(12, 1024).batch_size == 12


def test_without_room_it_releases_first_and_then_runs():
    process = ScriptedProcess(resident=595 * MiB)
    released = []
    guard = _guard(process, budget=600 * MiB, margin_bytes=8 * MiB, release=[lambda: released.append("tokenizer")])
    process.resident_after_trim = 580 * MiB  # the freed heap goes back: 12 MiB of room
    admitted = guard.admit(16, 1024)
    assert released == ["tokenizer"] and process.trims == 1
    assert admitted.batch_size == 12


def test_a_reserve_kept_for_a_busy_thread_is_waited_out_before_a_refusal():
    process = ScriptedProcess(resident=580 * MiB)
    guard = _guard(process, budget=600 * MiB, concurrent_bytes=20 * MiB, margin_bytes=8 * MiB)
    busy = [True]
    with guard.tracking(lambda: busy[0], lambda: busy.__setitem__(0, False)):
        # 600 - 580 - 20 - 8 < 0 while the thread works; once it is done, 600 - 580 - 8 = 12 MiB: 12 windows
        admitted = guard.admit(16, 1024)
    assert admitted.batch_size == 12 and not busy[0] and admitted.beside_bytes == 0
    assert process.trims == 0  # nothing was released: the file pages a release hands back would only fault back in


def test_without_room_even_after_releasing_it_refuses_with_a_budget_that_works():
    process = ScriptedProcess(resident=595 * MiB)
    guard = _guard(process, budget=600 * MiB, concurrent_bytes=20 * MiB, margin_bytes=8 * MiB)
    with pytest.raises(DoesNotFitError) as refused:
        guard.admit(4, 2048)
    assert process.trims == 1
    message = str(refused.value)
    assert "595 MiB" in message and "600 MiB" in message
    works = int(re.search(r"--memory-budget (\d+)MiB would work", message).group(1)) * MiB
    # the budget named fits one window beside what is held now, in flight and kept free: 595 + 20 + 8 + 2
    assert works >= (595 + 20 + 8 + 2) * MiB
    assert _guard(ScriptedProcess(595 * MiB), works, concurrent_bytes=20 * MiB).admit(4, 2048).batch_size >= 1


def test_file_pages_a_release_hands_back_are_kept_free_until_a_batch_has_run_and_what_came_back_is_learned():
    process = ScriptedProcess(resident=1016 * MiB, file_pages=200 * MiB)
    guard = _guard(process, budget=1024 * MiB, margin_bytes=8 * MiB, refault_bytes=30 * MiB)
    process.file_pages_trimmed = 100 * MiB
    # no room; the release takes 100 MiB of file pages, of which a forward faulted 30 back in at load:
    # 1024 - 916 - 8 - 30 = 70 MiB, 70 sequences
    first = guard.admit(100, 1024)
    assert first.batch_size == 70 and process.trims == 1
    process.fault_back(50 * MiB)  # while it ran, 50 came back: more than expected
    guard.done(first)
    second = guard.admit(100, 1024)  # 1024 - 966 - 8: nothing kept free for file pages any more
    assert second.batch_size == 50 and process.trims == 1
    guard.done(second)
    process.resident += 50 * MiB  # drift: no room again
    # the release takes 100 MiB again, and now 50 are expected back: 1024 - 916 - 8 - 50
    assert guard.admit(100, 1024).batch_size == 50 and process.trims == 2


def test_file_pages_a_batch_faults_back_after_a_release_are_not_taken_for_its_own_excess():
    process = ScriptedProcess(resident=1020 * MiB, file_pages=200 * MiB)
    guard = _guard(process, budget=1024 * MiB, margin_bytes=8 * MiB, refault_bytes=30 * MiB)
    process.file_pages_trimmed = 100 * MiB
    admitted = guard.admit(100, 1024)  # no room: the release takes 100 MiB, 30 kept free: 1024 - 920 - 8 - 30 = 66
    assert admitted.batch_size == 66 and process.trims == 1
    process.fault_back(30 * MiB)  # the 30 MiB it was expected to fault back in
    process.peak = process.resident + 66 * MiB + 6 * MiB  # its activations, and 6 MiB more: a new high-water mark
    guard.done(admitted)
    # 6 MiB beyond its prediction is within the 8 MiB margin; counting the 30 MiB refault it would have been 36
    assert guard.margin_bytes == 8 * MiB and guard.largest_added_bytes == 6 * MiB


def test_a_release_whose_pages_would_all_come_back_gives_no_room_and_the_refusal_counts_them():
    process = ScriptedProcess(resident=1016 * MiB, file_pages=200 * MiB)
    guard = _guard(process, budget=1024 * MiB, margin_bytes=8 * MiB, refault_bytes=100 * MiB)
    process.file_pages_trimmed = 100 * MiB
    with pytest.raises(DoesNotFitError) as refused:
        guard.admit(64, 1024)  # 1024 - 916 - 8 - 100 < 1 MiB
    message = str(refused.value)
    works = int(re.search(r"--memory-budget (\d+)MiB would work", message).group(1)) * MiB
    assert works >= (916 + 8 + 100 + 1) * MiB
    # every term it keeps free is named, so the figures add up to more than the budget it refused
    assert "holds 916 MiB" in message and "one sequence of 1024 tokens needs 1.0 MiB" in message
    assert "8 MiB as the margin of one batch" in message
    assert "100 MiB for the file pages a release took and the next batch faults back in" in message


def test_a_batch_that_adds_more_than_predicted_raises_the_margin_for_the_rest_of_the_run():
    process = ScriptedProcess(resident=500 * MiB)
    guard = _guard(process, budget=600 * MiB, margin_bytes=8 * MiB)
    admitted = guard.admit(10, 1024)  # 10 MiB predicted
    process.peak = 500 * MiB + 10 * MiB + 13 * MiB  # it really reached 13 MiB above the prediction
    guard.done(admitted)
    assert guard.margin_bytes == 13 * MiB and guard.largest_added_bytes == 13 * MiB
    # 600 - 500 - 13 = 87 MiB of room now, not 92
    assert guard.admit(100, 1024).batch_size == 87
    # a batch that stays under the high-water mark teaches nothing (its own peak is unknown)
    guard2 = _guard(ScriptedProcess(500 * MiB), budget=600 * MiB, margin_bytes=8 * MiB)
    guard2._read_peak = lambda: 900 * MiB  # an old peak far above: the batch set no new one
    guard2.done(guard2.admit(10, 1024))
    assert guard2.margin_bytes == 8 * MiB


class RecordingEngine:
    """Returns each window's first id; records every batch it runs and what the process held then."""

    def __init__(self, process: ScriptedProcess, growth: list[int]):
        self.process = process
        self.growth = growth  # what each of the first batches leaves resident for good
        self.batches: list[tuple[list[int], int]] = []

    def forward(self, windows):
        self.batches.append(([int(w.input_ids[0]) for w in windows], self.process.resident))
        if self.growth:
            self.process.resident += self.growth.pop(0)  # the resident set drifts up
        return [int(w.input_ids[0]) for w in windows]


def test_run_windows_cuts_batches_as_the_resident_set_drifts_and_keeps_order_and_each_window_once():
    process = ScriptedProcess(resident=500 * MiB)
    windows = [Window(i, 0, np.array([i] + [7] * 1023), None, 0, 1024) for i in range(40)]
    guard = _guard(process, budget=536 * MiB, margin_bytes=0)
    budget = AdaptiveBudget(BatchBudget(max_batch_tokens=16 * 1024), guard=guard)  # plan: 16, 16, 8
    engine = RecordingEngine(process, growth=[0, 30 * MiB])  # after the 2nd batch only 6 MiB are left
    results = run_windows(engine, windows, budget, torch.device("cpu"))
    assert results == list(range(40))  # in window order
    assert sorted(i for batch, _ in engine.batches for i in batch) == list(range(40))  # each exactly once
    for batch, resident in engine.batches:  # each batch fitted the room left when it started (1 MiB a window)
        assert len(batch) * MiB <= 536 * MiB - resident
    assert [len(batch) for batch, _ in engine.batches] == [16, 16, 6, 2] and guard.batches_cut == 1


def test_the_reserve_for_other_threads_is_kept_only_while_a_tracked_thread_may_still_allocate():
    process = ScriptedProcess(resident=560 * MiB)
    guard = _guard(process, budget=600 * MiB, concurrent_bytes=20 * MiB, margin_bytes=8 * MiB)

    def admitted() -> int:
        admission = guard.admit(32, 1024)
        guard.done(admission)
        return admission.batch_size

    assert admitted() == 12  # untracked (the server): 600 - 560 - 20 - 8 = 12 MiB of room, always
    preparing, writing = [True], [False]
    with guard.tracking(lambda: preparing[0], lambda: None), guard.tracking(lambda: writing[0], lambda: None):
        assert admitted() == 12  # the next block is being prepared: its thread may still allocate
        preparing[0] = False
        assert admitted() == 32  # both idle: what they hold is in the resident set, 600 - 560 - 8 = 32
        writing[0] = True
        assert admitted() == 12  # a part is being written
    preparing[0] = writing[0] = False
    assert admitted() == 12 and guard.beside_bytes() == 20 * MiB  # the stream has ended: untracked again
    # another thread's stream beside this one: its batches' own work between batches is not tracked, so the
    # reserve stays although every tracked thread is idle
    entered, leave = threading.Event(), threading.Event()

    def other_stream() -> None:
        with guard.tracking(lambda: False, lambda: None):
            entered.set()
            leave.wait(timeout=30)

    other = threading.Thread(target=other_stream)
    other.start()
    entered.wait(timeout=30)
    with guard.tracking(lambda: False, lambda: None):
        assert admitted() == 12
    leave.set()
    other.join()
    with guard.tracking(lambda: False, lambda: None):
        assert admitted() == 32  # this thread's stream alone again


def test_run_job_keeps_the_reserve_while_the_next_block_is_read_and_drops_it_once_it_is_ready():
    """The whole loop: the first batch is admitted while the thread reading the next block is still at work, so
    the reserve is kept (600 - 560 - 30 - 8 = 2 MiB: 2 windows); once that thread is done, the rest of the block
    gets the whole room (32 MiB: the batches run as planned, at most 8 windows)."""
    process = ScriptedProcess(resident=560 * MiB)
    guard = _guard(process, budget=600 * MiB, concurrent_bytes=30 * MiB, margin_bytes=8 * MiB)
    budget = AdaptiveBudget(BatchBudget(max_batch_tokens=8 * 1024), guard=guard)
    reading_on = threading.Event()

    def records():
        yield from (Record(i, i, f"text {i}", i + 1) for i in range(16))
        reading_on.wait(timeout=30)  # the next block's read goes on until the first batch has run

    class Job:
        def prepare(self, block):
            return PreparedBlock(
                [Window(int(r.id), 0, np.array([int(r.id)] + [7] * 1023), None, 0, 1024) for r in block]
            )

        def finish(self, block, prepared, outputs):
            return outputs

    class Engine:
        sizes: list[int] = []

        def forward(self, windows):
            self.sizes.append(len(windows))
            if not reading_on.is_set():
                reading_on.set()
                for _ in range(3000):  # until the reading thread has returned (bounded: 30 s)
                    if guard.beside_bytes() == 0:
                        break
                    time.sleep(0.01)
            return [int(w.input_ids[0]) for w in windows]

    engine = Engine()
    results = [
        out
        for _, block in run_job(Job(), records(), engine, budget, torch.device("cpu"), BlockLimits(16))
        for out in block
    ]
    assert results == list(range(16))
    assert engine.sizes == [2, 6, 8]  # the cut batch's other 6 windows run next, then the second planned batch
    assert guard.beside_bytes() == 30 * MiB  # the loop is over: nothing tracked


def test_the_background_writer_is_busy_from_submit_until_its_task_has_run():
    writer = BackgroundWriter(2)
    go = threading.Event()
    assert not writer.busy()
    writer.submit(go.wait, 30)
    assert writer.busy()
    go.set()
    writer.wait_idle()
    assert not writer.busy()
    writer.close()


REAL_PROCESS = r"""
import json, sys
import numpy as np
import memfit
from memfit.errors import DoesNotFitError
from memfit.memory.guard import resident_set_bytes
from memfit.memory.peak import settle_file_pages, trim_host_heap

model_dir, budget, room_spec = sys.argv[1], int(sys.argv[2]), sys.argv[3]
memfit.configure_process('cpu')
# PyTorch, so the forward passes can be recorded (the guard itself needs nothing from the backend)
encoder = memfit.Encoder(model_dir, dtype='fp32', memory_budget=budget, quality_check=False, backend='torch')
guard = encoder.budget.guard
sizes = []
forward = encoder.model.forward
def recording_forward(input_ids, **kwargs):
    sizes.append(int(input_ids.shape[0]))
    return forward(input_ids=input_ids, **kwargs)
encoder.model.forward = recording_forward
texts = [' '.join(['word%d' % (i % 7), 'the cat sat on the mat'] * 40) for i in range(48)]
encoder.embed(texts[:2])  # first forwards: kernels and pages every later batch needs are in
sizes.clear()
# ballast after the plan: "windows=W" leaves the room W windows of 256 tokens need; "bytes=B" is B bytes
kind, value = room_spec.split('=')
if kind == 'windows':
    # what W windows of 256 tokens are predicted to need (a batch's fixed cost once; a fraction of a window
    # as that fraction of one more window's cost)
    whole, part = divmod(float(value), 1)
    predict = lambda n: encoder.memory.activations.predict(n, 256)
    need = predict(int(whole)) + part * (predict(int(whole) + 1) - predict(int(whole)))
    # from the working set: file pages the guard can hand back are not room it can count on
    settle_file_pages(lambda: encoder.embed(texts[:2]))
    sizes.clear()
    admit = guard.admit
    ballast_bytes, ballast = 0, None

    def admit_beside_ballast(batch_size, padded_length):
        # the ballast goes in at the run's first admission, once it has read and tokenized its block: what the
        # run holds by then is in the room measured (measured before the run, the heap it grew back took ~12 MiB
        # of the room in CI). Freed heap is room to the guard (it trims before a cut), so not to the test either;
        # the reserve is kept only while another thread is at work, and the guard waits for it before a release
        global ballast_bytes, ballast
        guard.admit = admit
        trim_host_heap()
        room = budget - resident_set_bytes() - guard.margin_bytes
        ballast_bytes = max(0, int(room - need))
        ballast = np.ones(ballast_bytes // 8)
        return admit(batch_size, padded_length)

    guard.admit = admit_beside_ballast
else:
    ballast_bytes = int(value)
    ballast = np.ones(ballast_bytes // 8)
try:
    vectors = encoder.embed(texts, long='truncate')
    outcome = {'vectors': vectors[:4].tolist()}
except DoesNotFitError as exc:
    outcome = {'refused': str(exc)}
status = dict(line.split(':', 1) for line in open('/proc/self/status'))
outcome.update(sizes=sizes, planned=encoder.budget.base.max_batch_tokens // 256, cut=guard.batches_cut,
               ballast_bytes=ballast_bytes,
               peak=int(status['VmHWM'].split()[0]) * 1024)
print(json.dumps(outcome))
"""


def _real_run(model_dir: str, budget: int, room: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", REAL_PROCESS, model_dir, str(budget), room], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_in_a_real_process_ballast_after_the_plan_shrinks_the_batches_and_the_peak_stays_under(minilm_dir):
    budget = 1024 * MiB
    # room for 3 windows and a quarter: what the resident set wobbles by between batches (a few MiB: file pages,
    # freed heap) must not make room for a 4th. A quarter short of it is ~3.2 MiB on MiniLM fp32 (~4.3 MiB a
    # window), as half a window was under the floor that counted a layer's every tensor at once (~6.7 MiB)
    run = _real_run(minilm_dir, budget, "windows=3.25")
    assert "vectors" in run, run["refused"]
    assert run["planned"] >= 8  # the plan alone would have run batches of 8 windows of 256 tokens
    assert run["cut"] > 0 and max(run["sizes"]) <= 3, run["sizes"]
    assert run["peak"] <= budget, f"peak {run['peak'] / MiB:.1f} MiB over {budget / MiB:.0f} MiB"
    # the vectors are the model's: a plain transformers forward, mean-pooled, truncated to the window
    texts = [" ".join([f"word{i % 7}", "the cat sat on the mat"] * 40) for i in range(4)]
    reference = fp32_reference(minilm_dir, texts, max_length=256)
    np.testing.assert_allclose(np.array(run["vectors"]), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_in_a_real_process_no_room_for_one_window_is_refused_naming_a_budget_that_works(minilm_dir):
    budget = 1024 * MiB
    run = _real_run(minilm_dir, budget, "windows=0.2")
    assert "refused" in run, run
    works = int(re.search(r"--memory-budget (\d+)MiB would work", run["refused"]).group(1)) * MiB
    assert works > budget and run["sizes"] == [] and run["peak"] <= budget
    # the same ballast under the budget named runs through, under it
    again = _real_run(minilm_dir, works, f"bytes={run['ballast_bytes']}")
    assert "vectors" in again and again["peak"] <= works, again.get("refused")


# -- handing back clean file pages (memory/peak.py) -------------------------------------------------------

UNMAP_PROBE = r"""
import ctypes, mmap, sys
from memfit.memory.peak import file_resident_bytes, unmap_clean_file_pages

path, size = sys.argv[1], int(sys.argv[2])
with open(path, "rb") as fh:
    clean = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    copied = mmap.mmap(fh.fileno(), 1 << 20, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    copied[:8] = b"changed!"  # a private copy of one page, as the loader's relocations make
    address = ctypes.addressof(ctypes.c_char.from_buffer(copied))
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(1 << 20), mmap.PROT_READ) == 0
checksum = sum(clean[i] for i in range(0, size, 4096))  # touch every page
before = file_resident_bytes()
unmap_clean_file_pages()
after = file_resident_bytes()
print(before, after, checksum == sum(clean[i] for i in range(0, size, 4096)), copied[:8] == b"changed!")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_clean_library_pages_leave_the_resident_set_and_read_back_the_same_while_private_copies_stay(tmp_path):
    # a file mapped private and read-only under a library's name, as the loader maps a library's code
    library = tmp_path / "libweights.so"
    size = 64 * MiB
    library.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    result = subprocess.run(
        [sys.executable, "-c", UNMAP_PROBE, str(library), str(size)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    before, after, same_bytes, copy_kept = result.stdout.split()
    assert int(before) - int(after) >= 60 * MiB  # the 64 MiB mapping left the resident set...
    assert same_bytes == "True"  # ...and faults back in from the file unchanged
    assert copy_kept == "True"  # a read-only mapping holding a private copy was left alone


SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fe:00 11 /venv/torch/lib/libtorch_cpu.so
Rss:                1024 kB
Anonymous:             0 kB
Swap:                  0 kB
VmFlags: rd mr mw me sd
7f0000100000-7f0000101000 r--p 00100000 fe:00 11 /venv/torch/lib/libtorch_cpu.so
Rss:                   4 kB
Anonymous:             4 kB
Swap:                  0 kB
VmFlags: rd mr mw me ac sd
7f0000101000-7f0000102000 r--p 00101000 fe:00 12 /usr/lib/x86_64-linux-gnu/libc.so.6
Anonymous:             0 kB
Swap:                  4 kB
VmFlags: rd mr mw me ac sd
7f0000200000-7f0000300000 r-xp 00000000 fe:00 13 /opt/my libs/libz.so.1.2
Anonymous:             0 kB
VmFlags: rd ex mr mw me sd
7f0000300000-7f0000400000 r--p 00000000 fe:00 14 /venv/model/model.safetensors
Anonymous:             0 kB
VmFlags: rd mr mw me sd
7f0000400000-7f0000500000 r--s 00000000 fe:00 15 /venv/lib/libshared.so
Anonymous:             0 kB
VmFlags: rd sh mr mw me ms sd
7f0000500000-7f0000600000 rw-p 00000000 fe:00 16 /venv/lib/libdata.so
Anonymous:             0 kB
VmFlags: rd wr mr mw me ac sd
7f0000600000-7f0000700000 r--p 00000000 fe:00 17 /venv/lib/libold.so (deleted)
Anonymous:             0 kB
VmFlags: rd mr mw me sd
7f0000700000-7f0000800000 r--p 00000000 00:10 18 /dev/hugepages/libhuge.so
Anonymous:             0 kB
VmFlags: rd mr mw me sd
7f0000800000-7f0000900000 r--p 00000000 00:11 19 /mnt/hugetlbfs/libpages.so
Anonymous:             0 kB
VmFlags: rd mr mw me ht sd
7f0000900000-7f0000a00000 r--p 00000000 fe:00 20 /venv/lib/libnoanon.so
Rss:                   0 kB
7f0000a00000-7f0000a21000 rw-p 00000000 00:00 0
Anonymous:            12 kB
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
Anonymous:             0 kB
"""


def test_only_private_read_only_library_mappings_without_pages_of_their_own_are_picked():
    picked = clean_library_mappings(SMAPS)
    # the clean library code, and the library under a path with a space; not: a block with a private copy
    # (RELRO), one with a page in swap, a data file, shared or writable mappings, a deleted library, device and
    # hugetlb files, a block whose Anonymous line is missing, anonymous memory
    assert picked == [(0x7F0000000000, 0x7F0000100000), (0x7F0000200000, 0x7F0000300000)]
