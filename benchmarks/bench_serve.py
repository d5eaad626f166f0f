"""memfit serve vs infinity-emb vs a plain FastAPI + sentence-transformers server, same model, loopback.

    flock /tmp/memfit-bench.lock python benchmarks/bench_serve.py [--servers memfit,infinity,plain]
        [--infinity-bin /work/venv-infinity/bin/infinity_emb] [--out benchmarks/results/serve.json]
        [--append] [--round N] [--before-src DIR]

On a shared machine, run one server per invocation and alternate them (A/B/A/B), each invocation
under the lock, with ``--append`` collecting the rows in one JSON (``--round`` tags them):

    for r in 1 2; do for s in memfit infinity plain; do
        flock /tmp/memfit-bench.lock python benchmarks/bench_serve.py --servers $s --round $r --append
    done; done

``memfit`` serves in fp32 like the others; ``memfit-auto`` with memfit's default ``--dtype auto``.
``memfit-one-worker`` is memfit serve with ``--model-workers 1 --threads 2`` (one two-thread model worker, as
infinity runs, instead of one one-thread worker per core); ``memfit-lookahead-N`` chooses each batch
from the N oldest queued texts (``--lookahead N``). ``memfit-before`` runs memfit serve from
another source tree (``--before-src``, e.g. an older
checkout's ``src``), to compare a change under the same load.

Every server serves the bundled all-MiniLM-L6-v2 (``memfit.engine.models.resolve_model_name(None)``) on
127.0.0.1, in fp32 on the CPU, one at a time. memfit runs with ``--memory-budget 1GiB``; the others have
no memory limit. infinity-emb needs ``transformers<5``, so it runs from its own virtualenv
(docs/benchmarks.md says how it was built).

Load (bounded: a fixed number of requests per scenario, then stop): for short texts (movie-review
sentences, gensim's ``pang_lee_polarity.cor``) and long documents (~2,000 characters of news text, about
450 tokens, longer than the model's 256-token window; ``corpus.long_documents``), 1 and 8 texts per
request, 1, 16 and 64 concurrent clients, and 4 clients of one short text each (long documents: not
8 x 64, which holds 512 documents in flight at once: minutes per server on two shared cores). Each client
sends its requests back to back (closed loop) through one shared HTTP connection pool. A scenario that has
run ``MAX_SECONDS`` sends no new requests, finishes those in flight and is marked ``complete: false``.

Measured per scenario: texts/s (texts answered / wall time), p50 / p99 request latency, errors (any
non-200 or transport error), the server's peak RSS during the scenario (VmHWM of the server process
and its children, reset before each scenario through ``/proc/PID/clear_refs``), and the share of the
texts' tokens the vectors cover: memfit chunks long texts (every token is owned by one window), the
others keep the first ``max_seq_length`` tokens (checked: their long-document vector equals
sentence-transformers' truncated one).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402
import corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUDGET = "1GiB"
WINDOW = 256  # all-MiniLM-L6-v2's max_seq_length: what the truncating servers keep
SCENARIOS = [
    (kind, per_request, clients)
    for kind in ("short", "long")
    for per_request in (1, 8)
    for clients in (1, 16, 64)
    if (kind, per_request, clients) != ("long", 8, 64)
] + [("short", 1, 4)]  # low load: a few clients, one text each
TARGET_TEXTS = {"short": 256, "long": 32}  # texts per scenario, at least one request per client
MAX_SECONDS = 60.0  # then a scenario sends no new requests
MEMFIT_VARIANTS = {  # server name -> memfit serve options beyond the shared ones
    "memfit-auto": ["--dtype", "auto"],  # memfit's default precision (bf16 where the CPU runs it fast)
    "memfit-one-worker": ["--model-workers", "1", "--threads", "2"],
    "memfit-lookahead-64": ["--lookahead", "64"],
    "memfit-lookahead-32": ["--lookahead", "32"],
}

COLUMNS = [
    ("server", "server", ""),
    ("round", "round", "d"),
    ("texts", "texts", ""),
    ("per_request", "per req", "d"),
    ("clients", "clients", "d"),
    ("texts_per_s", "texts/s", ".1f"),
    ("p50_ms", "p50 ms", ".1f"),
    ("p99_ms", "p99 ms", ".1f"),
    ("errors", "errors", "d"),
    ("peak_rss_mib", "peak RSS MiB", ".0f"),
    ("token_coverage", "tokens covered", ".3f"),
    ("load_avg_1m", "load", ".1f"),
]


def short_texts() -> list[str]:
    from gensim.test.utils import datapath

    lines = open(datapath("pang_lee_polarity.cor"), encoding="utf-8", errors="replace").read().splitlines()
    return [line.strip() for line in lines if line.strip()]


def long_texts(n: int = 96) -> list[str]:
    return [corpus.long_documents((2_000,), seed=i)[0] for i in range(n)]


# -- servers -------------------------------------------------------------------------------------------


def server_command(
    name: str, model: str, port: int, infinity_bin: str, before_src: str | None = None
) -> tuple[list[str], str, dict]:
    """(command, embeddings path, extra environment) of one server."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    if name in ("memfit", "memfit-before", *MEMFIT_VARIANTS):
        if name == "memfit-before":
            if not before_src:
                raise ValueError("memfit-before needs --before-src")
            env["PYTHONPATH"] = before_src
        return (
            [
                sys.executable,
                "-m",
                "memfit",
                "serve",
                "--port",
                str(port),
                "--memory-budget",
                BUDGET,
                "--dtype",
                "fp32",
                *MEMFIT_VARIANTS.get(name, []),
            ],
            "/v1/embeddings",
            env,
        )
    if name == "infinity":
        env.pop("PYTHONPATH")
        return (
            [
                infinity_bin,
                "v2",
                "--model-id",
                model,
                "--served-model-name",
                "minilm",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--device",
                "cpu",
                "--engine",
                "torch",
                "--dtype",
                "float32",
                "--no-vector-disk-cache",
                "--url-prefix",
                "",
                "--log-level",
                "warning",
            ],
            "/embeddings",
            env,
        )
    if name == "plain":
        return (
            [sys.executable, str(ROOT / "benchmarks" / "_st_server.py"), "--model", model, "--port", str(port)],
            "/v1/embeddings",
            env,
        )
    raise ValueError(name)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    command: list[str], env: dict, url: str, timeout: float = 600, probe: str = "/health", log_path: str | None = None
) -> subprocess.Popen:
    """Start a server (its output to ``log_path``) and wait until ``probe`` answers 200 (memfit's readiness
    probe is ``/ready``: its ``/health`` is liveness, 200 while the model still loads)."""
    log = open(log_path or f"/tmp/bench-serve-{Path(command[0]).name}-{os.getpid()}.log", "w")
    proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[:3]} exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{command[:3]} not healthy after {timeout}s")


def process_tree(pid: int) -> list[int]:
    import psutil

    root = psutil.Process(pid)
    return [root.pid] + [child.pid for child in root.children(recursive=True)]


def reset_peak(pid: int) -> None:
    for p in process_tree(pid):
        Path(f"/proc/{p}/clear_refs").write_text("5")


def peak_mib(pid: int) -> float:
    return sum(_measure.status_kib("VmHWM", p) or 0 for p in process_tree(pid)) / 1024


# -- load ----------------------------------------------------------------------------------------------


async def run_load(
    url: str,
    model: str,
    texts: list[str],
    per_request: int,
    clients: int,
    target: int,
    max_seconds: float = MAX_SECONDS,
) -> dict:
    """``clients`` closed-loop clients sending about ``target`` texts in all, back to back (none new
    after ``max_seconds``)."""
    rounds = max(1, math.ceil(target / (clients * per_request)))
    bodies = [
        [texts[(r * clients * per_request + c * per_request + i) % len(texts)] for i in range(per_request)]
        for r in range(rounds)
        for c in range(clients)
    ]
    latencies: list[float] = []
    errors = 0
    answered = 0
    deadline = time.perf_counter() + max_seconds
    queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal errors, answered
        while not queue.empty() and time.perf_counter() < deadline:
            body = queue.get_nowait()
            started = time.perf_counter()
            try:
                response = await client.post(url, json={"input": body, "model": model, "encoding_format": "float"})
                ok = response.status_code == 200 and len(response.json()["data"]) == len(body)
            except (httpx.HTTPError, ValueError, KeyError):
                ok = False
            latencies.append(time.perf_counter() - started)
            errors += not ok
            answered += len(body) if ok else 0

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(latencies),
        "texts_total": answered,
        "complete": len(latencies) == len(bodies),
        "wall_s": round(wall, 2),
        "texts_per_s": answered / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)],
        "errors": errors,
    }


def coverage(name: str, lengths: list[int]) -> float:
    """Share of the texts' tokens (specials included) that the returned vectors are computed from."""
    if name.startswith("memfit"):
        return 1.0  # chunked: every token sits in the window that owns it (tests/data/test_chunking.py)
    return sum(min(n, WINDOW) for n in lengths) / sum(lengths)


def truncation_check(url: str, model: str, doc: str, reference: np.ndarray) -> float:
    """Cosine of a server's vector for a long document with sentence-transformers' truncated one."""
    response = httpx.post(url, json={"input": [doc], "model": model, "encoding_format": "float"}, timeout=600)
    vector = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float64)
    return float(vector @ reference / (np.linalg.norm(vector) * np.linalg.norm(reference)))


def bench_server(
    name: str,
    model_dir: str,
    infinity_bin: str,
    data: dict,
    reference: np.ndarray,
    before_src: str | None = None,
    round_no: int = 1,
    scenarios: list = SCENARIOS,
) -> list[dict]:
    port = free_port()
    command, path, env = server_command(name, model_dir, port, infinity_bin, before_src)
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = start(command, env, base, probe="/ready" if name.startswith("memfit") else "/health")
    startup_s = time.perf_counter() - started
    served = "all-MiniLM-L6-v2" if name.startswith("memfit") else "minilm"
    rows = []
    try:
        startup_peak = peak_mib(proc.pid)
        cosine = truncation_check(base + path, served, data["long"][0], reference)
        asyncio.run(_warm(base + path, served, data["short"]))
        for kind, per_request, clients in scenarios:
            reset_peak(proc.pid)
            load_before = os.getloadavg()[0]  # other processes' load on this (shared) machine
            result = asyncio.run(run_load(base + path, served, data[kind], per_request, clients, TARGET_TEXTS[kind]))
            row = {
                "server": name,
                "round": round_no,
                "texts": kind,
                "per_request": per_request,
                "clients": clients,
                **result,
                "peak_rss_mib": peak_mib(proc.pid),
                "startup_peak_rss_mib": startup_peak,
                "startup_s": round(startup_s, 1),
                "token_coverage": coverage(name, data[f"{kind}_lengths"]),
                "long_doc_cosine_vs_truncated": cosine,
                "load_avg_1m": round(load_before, 2),
            }
            rows.append(row)
            _measure.print_table([row], COLUMNS)
            sys.stdout.flush()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


async def _warm(url: str, model: str, texts: list[str]) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(8):
            await client.post(
                url, json={"input": texts[i * 8 : (i + 1) * 8], "model": model, "encoding_format": "float"}
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="memfit,infinity,plain")
    parser.add_argument("--infinity-bin", default="/work/venv-infinity/bin/infinity_emb")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve.json"))
    parser.add_argument("--append", action="store_true", help="add the rows to those already in --out")
    parser.add_argument("--round", type=int, default=1, help="tags the rows (alternating invocations)")
    parser.add_argument("--before-src", default=None, help="source tree of the memfit-before server")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the servers this many times, alternating (A/B/A/B), in this one invocation",
    )
    parser.add_argument(
        "--scenarios", default=None, help="only these, e.g. short:8:16,long:1:16 (texts:per request:clients)"
    )
    args = parser.parse_args()

    from memfit.engine.models import resolve_model_name

    model_dir = resolve_model_name(None)
    data = {"short": short_texts(), "long": long_texts()}
    data["short_lengths"] = corpus.token_lengths(data["short"])
    data["long_lengths"] = corpus.token_lengths(data["long"])
    baseline = _measure.sentence_transformer(model_dir)
    reference = _measure.st_encode(baseline, [data["long"][0]])[0].astype(np.float64)
    print(
        f"short texts: {len(data['short'])}, median {statistics.median(data['short_lengths'])} tokens; "
        f"long documents: {len(data['long'])}, median {statistics.median(data['long_lengths'])} tokens"
    )
    quiet = _measure.wait_for_quiet_cpu(15)
    rows: list[dict] = []
    scenarios = SCENARIOS
    if args.scenarios:
        scenarios = [(k, int(n), int(c)) for k, n, c in (item.split(":") for item in args.scenarios.split(","))]
    for name, round_no in [(n, args.round + r) for r in range(args.rounds) for n in args.servers.split(",")]:
        try:
            rows += bench_server(
                name, model_dir, args.infinity_bin, data, reference, args.before_src, round_no, scenarios
            )
        except Exception as exc:  # noqa: BLE001 - a server that cannot run is reported, the others still run
            rows.append({"server": name, "round": round_no, "error": f"{type(exc).__name__}: {exc}"})
            print(f"! {name}: {exc}", file=sys.stderr)
    for row in rows:
        row["cpu_quiet"] = quiet
    if args.append and Path(args.out).exists():
        import json

        rows = json.loads(Path(args.out).read_text())["rows"] + rows
    print()
    _measure.print_table(rows, COLUMNS)
    payload = {
        "budget": BUDGET,
        "window": WINDOW,
        "scenarios": SCENARIOS,
        "target_texts": TARGET_TEXTS,
        "max_seconds": MAX_SECONDS,
        "short_median_tokens": statistics.median(data["short_lengths"]),
        "long_median_tokens": statistics.median(data["long_lengths"]),
        "rows": rows,
    }
    print(f"\nwrote {_measure.write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
