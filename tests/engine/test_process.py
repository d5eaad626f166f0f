"""``configure_process``: the process-wide settings the budget promise relies on, checked in a child process as an
entry point sets them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
