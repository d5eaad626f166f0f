"""The compiled backends' graph cache (engine/graph_cache.py): what a conversion killed mid-way leaves behind, and one
graph per model wherever its files are."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from conftest import _tiny_config, _tokenizer, _write_vocab, with_graphs
from reference_outputs import fp32_reference
from memfit.engine.graph_cache import cached_or_converted, run_conversion_child
from memfit.errors import ModelLoadError


def _finished_pid() -> int:
    """The pid of a process that has exited: the writer of a file left by a kill."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_conversion_removes_the_half_written_files_of_killed_conversions_and_keeps_everything_else(
    tmp_path, monkeypatch
):
    """A conversion child killed by the out-of-memory killer leaves its private temporary graph (hundreds of MB) in
    the graph's folder, and nothing renamed or removed it. The next conversion of that graph removes the files of
    writers that are gone and that nothing wrote for an hour, and keeps a live or recent writer's file and every
    finished file."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "onnxruntime" / "0123abcd"
    entry.mkdir(parents=True)
    dead, alive, recent = _finished_pid(), os.getpid(), _finished_pid()
    abandoned = [f".model.{dead}.tmp.onnx", f".model.{dead}.tmp.onnx.classic", f".model.{dead}.tmp.bin"]
    kept = [f".model.{alive}.tmp.onnx", "snapshot.json", "model.onnx.tmp", f"model.{dead}.onnx", ".model.onnx"]
    an_hour_ago = time.time() - 3601
    for name in abandoned + kept:
        (entry / name).write_bytes(b"x" * 10)
        os.utime(entry / name, (an_hour_ago, an_hour_ago))
    # a writer whose pid is not running here but that wrote a minute ago: another container's, still converting
    kept.append(f".model.{recent}.tmp.onnx")
    (entry / kept[-1]).write_bytes(b"x" * 10)
    os.utime(entry / kept[-1], (time.time() - 60, time.time() - 60))
    graph = entry / "model.onnx"

    def convert(folder: Path | None) -> None:
        assert folder == entry
        graph.write_bytes(b"the graph")

    path, made = cached_or_converted("onnxruntime", "ONNX", str(tmp_path), "last_hidden_state", lambda: graph, convert)
    assert (path, made) == (graph, True)
    assert sorted(p.name for p in entry.iterdir()) == sorted([*kept, "model.onnx"])


def test_a_graph_found_in_the_cache_leaves_the_folder_as_it_is(tmp_path, monkeypatch):
    """Only a conversion cleans up (under the lock the folder's writers take): a reader of a cached graph touches
    nothing, so it never races a writer it cannot see."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "onnxruntime" / "0123abcd"
    entry.mkdir(parents=True)
    leftover = entry / f".model.{_finished_pid()}.tmp.onnx"
    leftover.write_bytes(b"half")
    graph = entry / "model.onnx"
    graph.write_bytes(b"the graph")

    def convert(folder: Path | None) -> None:
        raise AssertionError("a cached graph is not converted again")

    assert cached_or_converted("onnxruntime", "ONNX", str(tmp_path), "last_hidden_state", lambda: graph, convert) == (
        Path(graph),
        False,
    )
    assert leftover.exists()


KILLED_WHILE_WRITING = """
import os, pathlib, signal, sys
folder = pathlib.Path(sys.argv[1])
(folder / f".model.{os.getpid()}.tmp.onnx").write_bytes(b"half a graph")
(folder / f".model.{os.getpid()}.tmp.onnx.classic").write_bytes(b"its trace")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_conversion_child_killed_while_it_writes_leaves_nothing_behind_and_other_files_stay(tmp_path):
    """The out-of-memory killer stops an export child mid-write: its half-written files go at once (the graph is
    then made by the plain export, and no later conversion would look in that folder again). Another writer's
    recent file stays."""
    other = tmp_path / f".model.{_finished_pid()}.tmp.onnx"
    other.write_bytes(b"someone else's")
    killed = [sys.executable, "-c", KILLED_WHILE_WRITING, str(tmp_path)]
    with pytest.raises(ModelLoadError, match="failed"):
        run_conversion_child(killed, "failed", writes_in=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


def test_models_kept_under_a_cache_folder_each_run_their_own_graph(tmp_path):
    """Hugging Face keeps hub models under ``~/.cache/huggingface/hub``, and the graph's key left out every file
    whose path passed through a ``.cache`` folder (meant: one inside the model's directory). Every model kept there
    had the same key, and the second one run read the first one's graph: multilingual-e5-small, run after
    all-mpnet-base-v2 from ``~/.cache/memfit-models``, gave 768-dimensional vectors. A ``.cache`` folder inside a
    model's directory (``hf download --local-dir``'s records) still changes nothing."""
    from transformers import BertModel

    from memfit.engine.openvino.cache import graph_file

    texts = ["a short text", "another one, a little longer than the first"]
    hub = tmp_path / ".cache" / "huggingface" / "hub"
    models = []
    for seed in (0, 1):
        root = hub / f"models--tiny--bert-{seed}" / "snapshots" / "0123abcd"
        root.mkdir(parents=True)
        tok = _tokenizer(_write_vocab(root / "vocab.txt"))
        torch.manual_seed(seed)
        BertModel(_tiny_config(tok.vocab_size)).eval().save_pretrained(root)
        tok.save_pretrained(root)
        models.append(with_graphs(str(root), openvino=("last_hidden_state",)))
    for model_dir in models:
        got = memfit.Encoder(model_dir, dtype="fp32", backend="openvino").embed(texts)
        np.testing.assert_allclose(got, fp32_reference(model_dir, texts, max_length=128), atol=1e-5)

    key = graph_file(models[0], "last_hidden_state")
    records = Path(models[0]) / ".cache" / "huggingface" / "download"
    records.mkdir(parents=True)
    (records / "model.safetensors.metadata.json").write_text("{}")
    assert graph_file(models[0], "last_hidden_state") == key
