"""memfit on Ray Data (``--executor ray``, ``memfit.ray``) against local runs of the same jobs.

One local 2-CPU Ray cluster serves the whole module; the jobs join it (a cluster the process already
joined is used as it is), and the CLI runs in a subprocess join it by address. The reference for every
output is a local run of the same job, whose own correctness the other test modules establish against
sentence-transformers and the transformers pipeline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

import memfit  # noqa: E402
import memfit.ray  # noqa: E402
from memfit.jobs.classify import read_classifications  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.ray.worker import PartWorker  # noqa: E402
from conftest import kill_after_first_part, kill_at_a_moment  # noqa: E402
from reference_outputs import row_cosines  # noqa: E402

# per process. The local reference runs inside the pytest process, which by then holds ~850 MiB of earlier
# tests' state (Ray's driver, models): at 1 GiB its resident plan stopped fitting on a fresh install, `auto`
# streamed there and its manifest named another backend than the workers'. No peak is asserted here (the
# budget tests measure fresh processes: tests/memory/test_budget.py, tests/engine/test_offload.py).
BUDGET = "2GiB"

WORDS = "the quick brown fox jumps over a lazy dog while rain falls on seven quiet hills".split()


def _texts(n: int) -> list[str]:
    """Short and long texts (some over the tiny model's 128-token window), and one empty text."""
    texts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + (i * 37) % 60)) for i in range(n)]
    texts[5] = " ".join(WORDS * 30)  # ~480 tokens: four windows with --long chunk
    texts[7] = ""
    return texts


@pytest.fixture(scope="module")
def cluster():
    # "local": its own cluster even while test_ray_nodes' runs in the other pytest-xdist worker (Ray would join that
    # one, found in /tmp/ray/ray_current_cluster, and refuse num_cpus)
    ray.init(address="local", num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray-input") / "in.jsonl"
    path.write_text("".join(json.dumps({"body": t, "doc": f"d{i}"}) + "\n" for i, t in enumerate(_texts(230))))
    return path


def _assert_same_embeddings(got: Path, expected: Path) -> None:
    ours, reference = memfit.read(got), memfit.read(expected)
    assert ours.ids == reference.ids
    assert len(set(ours.ids)) == len(ours.ids)
    assert row_cosines(ours.embeddings, reference.embeddings).min() >= 0.99999
    assert ours.manifest["counts"] == reference.manifest["counts"]
    assert ours.manifest["settings"] == reference.manifest["settings"]
    assert "parts_ahead" not in ours.manifest and ours.manifest["complete"]
    assert set(ours.manifest) == set(reference.manifest)  # what a local run records, the Ray run records too
    assert ours.manifest["backend_choice"] == reference.manifest["backend_choice"]
    if reference.token_ids is not None:
        for ids, offsets, vectors, ids_ref, offsets_ref, vectors_ref in zip(
            ours.token_ids,
            ours.token_offsets,
            ours.token_embeddings,
            reference.token_ids,
            reference.token_offsets,
            reference.token_embeddings,
        ):
            np.testing.assert_array_equal(ids, ids_ref)
            np.testing.assert_array_equal(offsets, offsets_ref)
            assert row_cosines(vectors, vectors_ref).min() >= 0.99999


@pytest.fixture(scope="module")
def local_tokens_run(corpus, tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "out"
    memfit.Encoder(tiny_model_dir, dtype="fp32", memory_budget=BUDGET).embed_to(
        corpus, out, tokens=True, text_field="body", id_field="doc", part_size=40
    )
    return out


def test_embed_on_ray_equals_a_local_run_with_tokens(cluster, corpus, local_tokens_run, tiny_model_dir, tmp_path):
    manifest = memfit.ray.embed_to(
        str(corpus),
        str(tmp_path / "out"),
        model=tiny_model_dir,
        dtype="fp32",
        memory_budget=BUDGET,
        tokens=True,
        text_field="body",
        id_field="doc",
        workers=2,
        part_size=40,
    )
    assert manifest["rows"] == 230 and [p["first_row"] for p in manifest["parts"]] == list(range(0, 230, 40))
    _assert_same_embeddings(tmp_path / "out", local_tokens_run)
    assert not (tmp_path / "out" / ".memfit-scratch").exists()


def test_a_parquet_directory_is_read_in_parallel_with_rows_numbered_across_files(cluster, tiny_model_dir, tmp_path):
    texts = _texts(150)
    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.table({"text": texts[:90]}), folder / "a.parquet", row_group_size=25)
    pq.write_table(pa.table({"text": texts[90:]}), folder / "b.parquet", row_group_size=25)
    (tmp_path / "all.txt").write_text("\n".join(texts) + "\n")
    options = dict(model=tiny_model_dir, dtype="fp32", memory_budget=BUDGET)
    memfit.Encoder(**options).embed_to(tmp_path / "all.txt", tmp_path / "local")
    memfit.ray.embed_to(str(folder), str(tmp_path / "ray"), workers=2, part_size=64, **options)
    ours, reference = memfit.read(tmp_path / "ray"), memfit.read(tmp_path / "local")
    assert ours.ids == reference.ids == list(range(150))
    assert row_cosines(ours.embeddings, reference.embeddings).min() >= 0.99999


class KilledOnce(PartWorker):
    """Kills its own worker process (SIGKILL) on the batch that starts at ``row 80``, the first time only."""

    marker: str = ""

    def __call__(self, batch: pa.Table) -> pa.Table:
        if batch.column("row")[0].as_py() == 80 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(batch)


def test_a_worker_killed_mid_job_is_restarted_and_every_id_is_written_once(
    cluster, corpus, local_tokens_run, tiny_model_dir, tmp_path
):
    # workers cannot import this test module: Ray sends the class by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    KilledOnce.marker = str(tmp_path / "killed")
    memfit.ray.embed_to(
        str(corpus),
        str(tmp_path / "out"),
        model=tiny_model_dir,
        dtype="fp32",
        memory_budget=BUDGET,
        tokens=True,
        text_field="body",
        id_field="doc",
        workers=2,
        part_size=40,
        worker_class=KilledOnce,
    )
    assert (tmp_path / "killed").exists(), "the fault was never injected"
    _assert_same_embeddings(tmp_path / "out", local_tokens_run)


def test_kill_9_of_the_cli_job_then_resume_equals_an_uninterrupted_run(cluster, tiny_model_dir, tmp_path):
    texts = [t for _ in range(8) for t in _texts(250)]  # 2,000 texts: 40 parts of 50
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    args = [
        "embed",
        str(src),
        "--model",
        tiny_model_dir,
        "--dtype",
        "fp32",
        "--memory-budget",
        BUDGET,
        "--part-size",
        "50",
        "--executor",
        "ray",
        "--workers",
        "2",
        "--ray-address",
        cluster,
    ]
    killed_at = kill_after_first_part(args, tmp_path / "out", parts=2)

    resumed = subprocess.run(
        [sys.executable, "-m", "memfit", *args, "-o", str(tmp_path / "out"), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    manifest_path = tmp_path / "out" / "manifest.json"
    assert json.loads(manifest_path.read_text())["parts"][: len(killed_at["parts"])] == killed_at["parts"]
    memfit.Encoder(tiny_model_dir, dtype="fp32", memory_budget=BUDGET).embed_to(
        src, tmp_path / "straight", part_size=50
    )
    _assert_same_embeddings(tmp_path / "out", tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith("part-")) == ["manifest.json"]


def _resume_then_compare_with_a_straight_local_run(
    args: list[str], out: Path, src: Path, tiny_model_dir: str, straight: Path
) -> None:
    resumed = subprocess.run(
        [sys.executable, "-m", "memfit", *args, "-o", str(out), "--resume"], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    input_format = args[args.index("--input-format") + 1] if "--input-format" in args else None
    encoder = memfit.Encoder(tiny_model_dir, dtype="fp32", memory_budget=BUDGET)
    encoder.embed_to(src, straight, part_size=50, input_format=input_format)
    _assert_same_embeddings(out, straight)


def test_kill_9_before_the_first_part_is_listed_then_resume_completes(cluster, tiny_model_dir, tmp_path):
    """The run is killed once a worker has started its first part (its scratch directory exists) and
    before the manifest exists: the resume must clear what the killed run left and compute everything."""
    texts = [t for _ in range(4) for t in _texts(250)]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    out = tmp_path / "out"
    args = [
        "embed",
        str(src),
        "--model",
        tiny_model_dir,
        "--dtype",
        "fp32",
        "--memory-budget",
        BUDGET,
        "--part-size",
        "50",
        "--executor",
        "ray",
        "--workers",
        "2",
        "--ray-address",
        cluster,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", *args, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and not (out / ".memfit-scratch").exists():
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / ".memfit-scratch").exists(), "no worker started a part before the deadline"
    assert not (out / "manifest.json").exists(), "a part was listed before the kill; the moment was missed"

    _resume_then_compare_with_a_straight_local_run(args, out, src, tiny_model_dir, tmp_path / "straight")


@pytest.mark.parametrize("moment", ["start-up", "manifest-write"])
def test_kill_9_of_the_driver_at_start_up_or_while_it_writes_the_manifest_then_resume_completes(
    cluster, tiny_model_dir, tmp_path, moment
):
    texts = [t for _ in range(2) for t in _texts(250)]  # 500 texts: 10 parts of 50
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    out = tmp_path / "out"
    args = ["embed", str(src), "--model", tiny_model_dir, "--dtype", "fp32", "--memory-budget", BUDGET]
    args += ["--part-size", "50", "--executor", "ray", "--workers", "2", "--ray-address", cluster]
    args += ["--input-format", "txt"]  # in the manifest's settings, which the workers check on resume
    kill_at_a_moment(moment, args, out)
    _resume_then_compare_with_a_straight_local_run(args, out, src, tiny_model_dir, tmp_path / "straight")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("part-")) == ["manifest.json"]


@pytest.mark.parametrize(
    "write, fmt",
    [
        (lambda p: p.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": 3}\n'), "jsonl"),
        (
            lambda p: pq.write_table(pa.table({"text": ["fine"] * 30 + [None] + ["fine"] * 9}), p, row_group_size=10),
            "parquet",
        ),
    ],
)
def test_bad_input_gets_the_local_one_line_error(cluster, tiny_model_dir, tmp_path, capsys, write, fmt):
    src = tmp_path / f"in.{fmt}"
    write(src)
    common = [
        "embed",
        str(src),
        "--model",
        tiny_model_dir,
        "--dtype",
        "fp32",
        "--memory-budget",
        BUDGET,
        "--part-size",
        "10",
    ]
    assert main([*common, "-o", str(tmp_path / "local")]) == 2
    local = capsys.readouterr().err.strip().splitlines()
    assert main([*common, "-o", str(tmp_path / "ray"), "--executor", "ray", "--workers", "2"]) == 2
    on_ray = capsys.readouterr().err.strip().splitlines()
    assert on_ray == local and len(local) == 1 and local[0].startswith(f"memfit: error: {src}:")


def test_classify_on_ray_equals_a_local_run(cluster, corpus, tiny_model_dir, tmp_path):
    options = dict(model=tiny_model_dir, dtype="fp32", memory_budget=BUDGET)
    job = dict(labels=["weather", "animals", "hills"], text_field="body", id_field="doc", part_size=60)
    memfit.Classifier(**options).classify_to(corpus, tmp_path / "local", **job)
    memfit.ray.classify_to(str(corpus), str(tmp_path / "ray"), workers=2, **options, **job)
    ids, results = read_classifications(tmp_path / "ray")
    ref_ids, reference = read_classifications(tmp_path / "local")
    assert ids == ref_ids and len(set(ids)) == len(ids) == 230
    assert [r.labels for r in results] == [r.labels for r in reference]
    np.testing.assert_allclose([r.scores for r in results], [r.scores for r in reference], atol=1e-6)


def test_embed_dataset_adds_the_encoders_vectors_to_a_users_pipeline(cluster, tiny_model_dir):
    texts = _texts(60)
    ds = ray.data.from_items([{"text": t, "n": i} for i, t in enumerate(texts)])
    rows = memfit.ray.embed_dataset(
        ds, model=tiny_model_dir, dtype="fp32", memory_budget=BUDGET, batch_size=25
    ).take_all()
    got = np.array([r["embedding"] for r in sorted(rows, key=lambda r: r["n"])], dtype=np.float32)
    expected = memfit.Encoder(tiny_model_dir, dtype="fp32", memory_budget=BUDGET).embed(texts)
    assert row_cosines(got, expected).min() >= 0.99999


def test_engine_ray_without_ray_installed_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    (tmp_path / "in.txt").write_text("a text\n")
    assert main(["embed", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out"), "--executor", "ray"]) == 2
    assert capsys.readouterr().err == (
        "memfit: error: --executor ray needs Ray Data, which is not installed: pip install 'memfit[ray]'\n"
    )
    assert not (tmp_path / "out").exists()
