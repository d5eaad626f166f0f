"""``configure_process``: the process-wide settings the budget promise relies on, checked in a child process as an
entry point sets them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memfit.memory.device import GPU_DRIVER_PATHS

MiB = 2**20

WRITE_PARTS = r"""
import ctypes, json, sys
import memfit

memfit.configure_process('cpu')
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

def anonymous():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024

after = []
for part in range(4):
    vectors = np.random.default_rng(part).random((1400, 768)).astype(np.float32)
    ids = pa.array(range(part * 1400, (part + 1) * 1400))
    table = pa.table({'id': ids, 'embedding': pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 768)})
    pq.write_table(table, f'{sys.argv[1]}/part-{part}.parquet')
    del table, vectors
    ctypes.CDLL('libc.so.6').malloc_trim(0)
    after.append(anonymous())
print(json.dumps({'pool': pa.default_memory_pool().backend_name, 'after': after}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon from /proc/self/status, glibc's malloc_trim")
def test_parquet_parts_written_one_after_another_do_not_pile_up_in_the_resident_set(tmp_path):
    """Arrow's default pool (mimalloc) keeps what a written part freed, beyond glibc's reach: in this same child with
    ``ARROW_DEFAULT_MEMORY_POOL=mimalloc`` the anonymous resident set rose 34 MiB from the first of four parts of
    1,400 x 768 floats to the last, with the system allocator 8 MiB (the second part's one-time Parquet state; flat
    after it), 2-core AMD EPYC. In a configured process a part's tables go back when it is written."""
    result = subprocess.run(
        [sys.executable, "-c", WRITE_PARTS, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["pool"] == "system", report
    first, *_, last = report["after"]
    assert last - first < 20 * MiB, report


THREADS_BEFORE_AND_AFTER_TORCH = r"""
import json, sys
from memfit.engine.process import compute_threads
counted, torch_loaded = compute_threads(), "torch" in sys.modules
import torch
print(json.dumps([counted, torch_loaded, torch.get_num_threads()]))
"""


@pytest.mark.parametrize(
    "environment",
    [
        {},
        {"OMP_NUM_THREADS": "1"},
        {"OMP_NUM_THREADS": "64"},
        {"MKL_NUM_THREADS": "1"},
        {"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"},
    ],
)
def test_threads_are_counted_without_torch_as_torch_counts_them(environment):
    """A run on a compiled graph never imports torch, yet must run on the threads torch would have used (what the
    backend choice's verdict and the server's workers were measured with): torch itself is the reference."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(
        [sys.executable, "-c", THREADS_BEFORE_AND_AFTER_TORCH],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, **environment},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counted, torch_loaded, torch_threads = json.loads(done.stdout.strip().splitlines()[-1])
    assert not torch_loaded
    assert counted == torch_threads


DEVICE_BEFORE_AND_AFTER_TORCH = r"""
import json, sys
from memfit.memory.device import resolve_device
device, torch_loaded = resolve_device("auto"), "torch" in sys.modules
import torch
print(json.dumps([device, torch_loaded, "cuda" if torch.cuda.is_available() else "cpu"]))
"""


def test_auto_resolves_the_device_torch_would_and_without_torch_where_no_gpu_driver_is_present():
    done = subprocess.run(
        [sys.executable, "-c", DEVICE_BEFORE_AND_AFTER_TORCH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    device, torch_loaded, torch_device = json.loads(done.stdout.strip().splitlines()[-1])
    assert device == torch_device
    if torch_device == "cpu" and not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        assert not torch_loaded
