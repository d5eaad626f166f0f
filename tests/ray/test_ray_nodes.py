"""memfit on a Ray cluster of two nodes, each its own raylet and object store with one CPU
(``ray.cluster_utils.Cluster``): the work is spread over both nodes, the output equals a local run, and a worker
node killed mid-job (its raylet and every process on it, SIGKILL) loses nothing once the cluster replaces it.

The reference is a local run of the same job (tests/ray/test_ray.py and the other modules pin that to transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

ray = pytest.importorskip("ray")

import memfit  # noqa: E402
import memfit.ray  # noqa: E402
from memfit.ray.worker import PartWorker  # noqa: E402
from reference_outputs import row_cosines  # noqa: E402

# per process. The local reference runs inside the pytest process, which by then holds ~850 MiB of earlier
# tests' state (Ray's driver, models): at 1 GiB its resident plan stopped fitting on a fresh install, `auto`
# streamed there and its manifest named another backend than the workers'. No peak is asserted here (the
# budget tests measure fresh processes: tests/memory/test_budget.py, tests/engine/test_offload.py).
BUDGET = "2GiB"
WORDS = "the quick brown fox jumps over a lazy dog while rain falls on seven quiet hills".split()


def _texts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + (i * 37) % 60)) for i in range(n)]


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and a worker node of one CPU each; the test process joins it as a driver."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # another module's cluster
        ray.shutdown()
    store = 128 * 2**20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": store, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, object_store_memory=store)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


class NodeRecorder(PartWorker):
    """Writes the node each part ran on (one file per part), so the test sees where the work went."""

    marker_dir: str = ""

    def __call__(self, batch: pa.Table) -> pa.Table:
        result = super().__call__(batch)
        first = batch.column("row")[0].as_py()
        Path(self.marker_dir, f"{first}.node").write_text(ray.get_runtime_context().get_node_id())
        return result


def _recorded_job(texts_file: Path, out: Path, tiny_model_dir: str, marker_dir: Path) -> dict:
    """The job through the API, on workers that write the node of each part they run into ``marker_dir``."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module
    NodeRecorder.marker_dir = str(marker_dir)
    return memfit.ray.embed_to(
        str(texts_file),
        str(out),
        model=tiny_model_dir,
        dtype="fp32",
        memory_budget=BUDGET,
        workers=2,
        part_size=50,
        worker_class=NodeRecorder,
    )


def _local_run(texts_file: Path, out: Path, tiny_model_dir: str) -> Path:
    memfit.Encoder(tiny_model_dir, dtype="fp32", memory_budget=BUDGET).embed_to(texts_file, out, part_size=50)
    return out


def _assert_same(got: Path, expected: Path) -> None:
    ours, reference = memfit.read(got), memfit.read(expected)
    assert ours.ids == reference.ids and len(set(ours.ids)) == len(ours.ids)  # every id, exactly once
    assert row_cosines(ours.embeddings, reference.embeddings).min() >= 0.99999
    assert ours.manifest["complete"] and ours.manifest["counts"] == reference.manifest["counts"]


@pytest.mark.slow
def test_the_cli_on_two_nodes_spreads_the_work_and_equals_a_local_run(two_nodes, tiny_model_dir, tmp_path):
    texts_file = tmp_path / "in.txt"
    texts_file.write_text("\n".join(_texts(600)) + "\n")
    args = ["embed", str(texts_file), "-o", str(tmp_path / "out"), "--model", tiny_model_dir, "--dtype", "fp32"]
    args += ["--memory-budget", BUDGET, "--part-size", "50", "--executor", "ray", "--workers", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "memfit", *args, "--ray-address", two_nodes.address],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(tmp_path / "out", _local_run(texts_file, tmp_path / "local", tiny_model_dir))
    # the same job through the API with a worker that records its node: both nodes took parts (two workers of
    # 0.9 CPU cannot share a node of one CPU)
    _recorded_job(texts_file, tmp_path / "recorded", tiny_model_dir, tmp_path)
    nodes = {path.read_text() for path in tmp_path.glob("*.node")}
    assert nodes == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    _assert_same(tmp_path / "recorded", tmp_path / "local")


def test_without_an_address_the_cli_starts_its_own_cluster_beside_one_already_running(
    two_nodes, tiny_model_dir, tmp_path
):
    """docs/scale-out.md: without --ray-address the job starts a local cluster of --workers CPUs. Ray itself, given
    no address, joins the cluster it finds recorded in /tmp/ray (this module's, here, as a `ray start` one would be)
    and refuses the CPU count for it."""
    texts_file = tmp_path / "in.txt"
    texts_file.write_text("\n".join(_texts(120)) + "\n")
    args = ["embed", str(texts_file), "-o", str(tmp_path / "out"), "--model", tiny_model_dir, "--dtype", "fp32"]
    args += ["--memory-budget", BUDGET, "--part-size", "50", "--executor", "ray", "--workers", "1"]
    done = subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same(tmp_path / "out", _local_run(texts_file, tmp_path / "local", tiny_model_dir))
    assert all(node["Alive"] for node in ray.nodes()), "the running cluster was left as it was"


@pytest.mark.slow
def test_a_worker_node_killed_mid_job_is_replaced_and_every_id_is_written_once(two_nodes, tiny_model_dir, tmp_path):
    texts_file = tmp_path / "in.txt"
    texts_file.write_text("\n".join(_texts(1500)) + "\n")
    head = two_nodes.head_node.node_id
    (victim,) = [node for node in two_nodes.worker_nodes]
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["manifest"] = _recorded_job(texts_file, tmp_path / "out", tiny_model_dir, tmp_path)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = exc

    job = threading.Thread(target=run)
    job.start()
    deadline = time.time() + 240
    while time.time() < deadline and job.is_alive():
        if any(path.read_text() != head for path in tmp_path.glob("*.node")):
            break  # the worker node has finished a part: the job is under way there
        time.sleep(0.05)
    assert job.is_alive(), outcome
    two_nodes.remove_node(victim, allow_graceful=False)  # SIGKILL: its raylet, store and memfit worker
    two_nodes.add_node(num_cpus=1, object_store_memory=128 * 2**20)  # the cluster replaces the node
    job.join(timeout=300)
    assert not job.is_alive() and "error" not in outcome, outcome
    assert outcome["manifest"]["complete"]
    _assert_same(tmp_path / "out", _local_run(texts_file, tmp_path / "local", tiny_model_dir))
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["rows"] == 1500
