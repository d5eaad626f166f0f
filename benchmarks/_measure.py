"""Shared helpers for the benchmarks: run one method in a fresh subprocess, read peaks, build the
sentence-transformers baseline, print a table, write JSON with machine facts.

Parent side: :func:`run_in_subprocess` starts ``python SCRIPT --worker METHOD ...`` and turns
the worker's report into a result row (:func:`throughput_row`); :func:`status_kib` reads another
process's ``/proc`` status (a server's peak).
Worker side: :func:`worker_report` writes the timings plus the process's peak RSS.
Baseline: :func:`sentence_transformer` and :func:`st_encode`, what users run instead of memfit, built
one way for every benchmark. Imports nothing heavy at module level (the parent stays small, and a
peers' venv without memfit can import it).

Peak RSS: the worker reports two numbers read at its very end:

* ``peak_rss_mib`` -- ``VmHWM`` from ``/proc/self/status``: the high-water mark of the
  worker's own address space. This is the clean number used in the tables.
* ``ru_maxrss_mib`` -- ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux). Linux
  carries the *parent's* RSS at fork/exec time into the child's ``ru_maxrss``, so it is only
  clean when the parent is small; the harness keeps the parent small (no torch, corpus built
  in its own subprocess) and records both so they can be compared.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from importlib import metadata
from typing import Any, Iterable, Sequence

# ----------------------------------------------------------------------------- worker side


def status_kib(field: str, pid: int | str = "self") -> int | None:
    """A KiB field of ``/proc/PID/status`` (``VmHWM``, ``VmRSS``): None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_now_mib() -> float:
    """Current resident set size of this process, MiB."""
    kib = status_kib("VmRSS")
    if kib is None:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    return kib / 1024


def peak_rss() -> dict[str, float]:
    """Peak RSS of this process, MiB: VmHWM (own address space) and ru_maxrss.

    memfit resets VmHWM (``/proc/self/clear_refs``) to measure its own probes and training steps; when
    memfit is loaded, its record of the peaks before those resets is folded in, so the figure covers
    the whole run (model loading included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    hwm = status_kib("VmHWM")
    memory = sys.modules.get("memfit.memory.peak")
    if hwm is not None and memory is not None:
        hwm = max(hwm, memory.process_peak_rss_bytes() // 1024)
    return {
        "peak_rss_mib": round((hwm if hwm is not None else ru) / 1024, 1),
        "ru_maxrss_mib": round(ru / 1024, 1),
    }


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds`` (perf_counter wall clock) and
    ``sw.cpu_seconds`` (CPU time of this process, all threads: user + system)."""

    def __enter__(self) -> "Stopwatch":
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0


def worker_report(path: str, **fields: Any) -> dict:
    """Write the worker's report (``fields`` + peak RSS, measured now) as JSON to ``path``.

    Call it last, after the measured work, so the peak covers everything.
    """
    report = dict(fields)
    report.update(peak_rss())
    report["rss_at_end_mib"] = round(rss_now_mib(), 1)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=_json_default)
    os.replace(tmp, path)
    return report


# ----------------------------------------------------------------------------- the baseline

ST_BATCH_SIZE = 32
"""sentence-transformers' default ``encode`` batch size: the baseline as its users run it."""


def sentence_transformer(model: str, *, max_seq_length: int | None = None, device: str = "cpu", backend: str = "torch"):
    """``SentenceTransformer(model)``, the baseline every benchmark compares against, truncating at
    ``max_seq_length`` when given (else the model's own). ``backend``: ``torch`` | ``onnx`` | ``openvino``
    (sentence-transformers' own exports, in a peers' venv)."""
    from sentence_transformers import SentenceTransformer

    kwargs = {} if backend == "torch" else {"backend": backend}  # sentence-transformers < 3.2 has no backend
    baseline = SentenceTransformer(model, device=device, **kwargs)
    if max_seq_length is not None:
        baseline.max_seq_length = max_seq_length
    return baseline


def st_encode(model: Any, texts: Sequence[str], batch_size: int = ST_BATCH_SIZE, **kwargs: Any):
    """``model.encode`` as the baseline runs it: numpy rows, no progress bar (``kwargs``: prompts, devices)."""
    return model.encode(list(texts), batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False, **kwargs)


def min_cosine(a: Any, b: Any) -> float:
    """The smallest row-wise cosine between two matrices of vectors: memfit's own ``cosine_rows`` (float64, two
    zero rows count as identical), imported here so that this module stays light."""
    import numpy as np

    from memfit.engine.precision import cosine_rows

    return float(cosine_rows(np.asarray(a), np.asarray(b)).min())


# ----------------------------------------------------------------------------- parent side


def run_in_subprocess(
    argv: Sequence[str], result_path: str, *, timeout: float | None = None, env: dict | None = None
) -> dict:
    """Run ``argv`` (a worker command line that writes its report to ``result_path``) in a
    fresh process and return the report. On failure returns ``{"error": ...}`` with the tail
    of the worker's stderr. The worker's stdout/stderr are passed through to the console
    except that stderr is also kept for the error message."""
    env = dict(os.environ if env is None else env)
    env.setdefault("HF_HUB_OFFLINE", "1")  # everything ships offline
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bars
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(argv), stdout=None, stderr=subprocess.PIPE, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "wall_seconds": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    if proc.stderr:
        sys.stderr.write(_filter_noise(proc.stderr))
    if proc.returncode != 0 or not os.path.exists(result_path):
        tail = proc.stderr.strip().splitlines()[-6:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "wall_seconds": wall}
    with open(result_path) as f:
        report = json.load(f)
    report["wall_seconds"] = round(wall, 2)
    return report


def _filter_noise(text: str) -> str:
    # transformers warns once per long text that goes through the tokenizer untruncated
    noise = ("Token indices sequence length is longer",)
    return "".join(line for line in text.splitlines(True) if not any(n in line for n in noise))


def throughput_row(method: str, report: dict, *, texts: int, real_tokens: int, total_tokens: int) -> dict:
    """Result row: the worker report plus texts, real tokens and the derived rates.

    ``real_tokens``: non-padding tokens fed to the model (after truncation, incl. special
    tokens), counted from the tokenizer. ``total_tokens``: untruncated corpus tokens.
    """
    row: dict[str, Any] = {"method": method, "texts": texts, "real_tokens": real_tokens}
    row["tokens_covered_fraction"] = round(real_tokens / total_tokens, 4) if total_tokens else None
    row.update(report)
    secs = report.get("seconds")
    if secs and "error" not in report:
        row["tokens_per_s"] = round(real_tokens / secs, 1)
        row["texts_per_s"] = round(texts / secs, 2)
    return row


def cpu_ticks() -> tuple[int, int]:
    """The whole machine's busy and total CPU time since boot, in clock ticks (``os.sysconf("SC_CLK_TCK")`` a
    second), from /proc/stat: busy is all but idle and iowait (guest time is already counted in user)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(vals)
    return total - vals[3] - (vals[4] if len(vals) > 4 else 0), total


def cpu_busy_fraction(sample_s: float = 2.0) -> float | None:
    """Fraction of all CPUs busy (not idle/iowait) over ``sample_s`` seconds, from /proc/stat."""
    try:
        b0, t0 = cpu_ticks()
        time.sleep(sample_s)
        b1, t1 = cpu_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(t1 - t0, 1)


def wait_for_quiet_cpu(max_wait_s: float, threshold: float = 0.25, sample_s: float = 2.0) -> dict:
    """Wait (up to ``max_wait_s``) until other processes use less than ``threshold`` of the
    CPUs, so a timed run does not compete with them. Returns what it saw."""
    t0 = time.perf_counter()
    busy = cpu_busy_fraction(sample_s)
    while busy is not None and busy >= threshold and time.perf_counter() - t0 < max_wait_s:
        busy = cpu_busy_fraction(sample_s)
    return {
        "cpu_busy_before": None if busy is None else round(busy, 3),
        "waited_for_quiet_s": round(time.perf_counter() - t0, 1),
    }


# ----------------------------------------------------------------------------- batches


def length_sorted_batches(ids: Sequence[Sequence[int]], size: int) -> list[tuple[Any, dict[str, Any]]]:
    """Token-id rows cut into batches of ``size`` in length order, each padded to its longest: ``(rows, feed)``
    pairs, ``rows`` the indices into ``ids`` and ``feed`` the int64 ``input_ids``, ``attention_mask`` and
    ``token_type_ids`` a BERT-family graph takes. The bare-runtime rows of several benchmarks batch this way."""
    import numpy as np

    order = np.argsort([len(row) for row in ids], kind="stable")
    batches = []
    for start in range(0, len(order), size):
        chosen = order[start : start + size]
        width = max(len(ids[i]) for i in chosen)
        input_ids = np.zeros((len(chosen), width), np.int64)
        mask = np.zeros_like(input_ids)
        for row, i in enumerate(chosen):
            input_ids[row, : len(ids[i])] = ids[i]
            mask[row, : len(ids[i])] = 1
        batches.append(
            (chosen, {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(mask)})
        )
    return batches


# ----------------------------------------------------------------------------- output


Column = tuple  # (key, header, format) -- format is a str.format spec or a callable


def print_table(rows: Iterable[dict], columns: Sequence[Column] | None = None, file=None) -> None:
    """Print rows as an aligned text table. Missing values print as '-', rows with an
    ``error`` print it after the method name."""
    rows = list(rows)
    file = file or sys.stdout
    if columns is None:
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        columns = [(k, k, "") for k in keys]

    def cell(r: dict, key: str, fmt: Any) -> str:
        v = r.get(key)
        if v is None:
            return "-"
        if callable(fmt):
            return fmt(v)
        try:
            return format(v, fmt)
        except (TypeError, ValueError):
            return str(v)

    table = [[h for _, h, _ in columns]]
    for r in rows:
        table.append([cell(r, k, f) for k, _, f in columns])
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for j, line in enumerate(table):
        parts = [line[i].ljust(widths[i]) if i == 0 else line[i].rjust(widths[i]) for i in range(len(columns))]
        print("  ".join(parts).rstrip(), file=file)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=file)
    for r in rows:
        if r.get("error"):
            print(f"! {r.get('method')}: {r['error']}", file=file)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict:
    """CPU model, core counts, memory, library versions, date -- without importing torch."""
    cpu_model, flags, identity = None, "", {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = (part.strip() for part in line.partition(":"))
                if cpu_model is None and name == "model name":
                    cpu_model = value
                if not flags and name == "flags":
                    flags = value
                # "AMD EPYC" names several generations that run the same code at different speeds (docs/benchmarks.md,
                # "Reproduced by the runner"): family, model and stepping tell them apart
                if name in ("cpu family", "model", "stepping") and name not in identity:
                    identity[name] = value
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    isa = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if x in flags.split()]
    return {
        "cpu_model": cpu_model or platform.processor(),
        "cpu_family_model_stepping": "/".join(identity.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "cpu_flags_of_interest": isa,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": mem_total,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "sentence_transformers": _version("sentence-transformers"),
        "tokenizers": _version("tokenizers"),
        "numpy": _version("numpy"),
        "memfit": _version("memfit"),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def write_json(path: str, payload: dict) -> str:
    """Write ``payload`` plus ``machine`` facts to ``path`` (dirs created). Returns path."""
    out = {"machine": machine_facts()}
    out.update(payload)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2, default=_json_default)
        f.write("\n")
    return path


__all__ = [
    "ST_BATCH_SIZE",
    "Stopwatch",
    "cpu_busy_fraction",
    "wait_for_quiet_cpu",
    "machine_facts",
    "min_cosine",
    "peak_rss",
    "print_table",
    "rss_now_mib",
    "run_in_subprocess",
    "sentence_transformer",
    "st_encode",
    "status_kib",
    "throughput_row",
    "worker_report",
    "write_json",
]
