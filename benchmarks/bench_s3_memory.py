"""The memory budget with output in object storage: whole-process peaks of the same jobs written locally and to S3.

    python benchmarks/bench_s3_memory.py [--runs 3] [--budget 768MiB] [--out FILE]

An S3 upload holds its bytes in memory until they are sent: pyarrow's S3 stream buffers a multipart part (10 MiB)
before it uploads it, and memfit's object-storage writes are synchronous (``io/storage.py``), so one part at a
time. This runs each job under ``--budget`` twice per round, output local and output in a bucket of a moto S3
server on 127.0.0.1 (started here, as in ``tests/test_s3.py``), alternated, each in a fresh process inside
``peak_cli.py`` (VmHWM over the whole run):

- ``embed --tokens`` of one document of ~300k characters of real news (gensim's ``lee_background.cor``), ~100 MB
  of token rows: the largest upload memfit makes;
- pooled ``embed`` of 200 spans of 2,000 characters.

Not a test: prints a table and writes JSON (``benchmarks/results/s3-memory.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402
import corpus  # noqa: E402

MiB = 2**20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_s3() -> tuple[subprocess.Popen, dict[str, str]]:
    """A moto S3 server on loopback with a bucket ``out``; the AWS environment variables that reach it."""
    import boto3

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                raise SystemExit("the moto server did not start") from None
            time.sleep(0.1)
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
    }
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench", aws_secret_access_key="bench"
    ).create_bucket(Bucket="out")
    return server, env


def real_text() -> str:
    from gensim.test.utils import datapath

    with open(datapath("lee_background.cor"), encoding="utf-8") as fh:
        return " ".join(fh.read().split())


def write_jsonl(path: str, texts: list[str]) -> str:
    with open(path, "w") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text}) + "\n")
    return path


def peak_run(argv: list[str], env: dict[str, str], workdir: str) -> dict:
    report = os.path.join(workdir, "peak.json")
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "peak_cli.py"), report, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "HF_HUB_OFFLINE": "1"},
    )
    if result.returncode != 0:
        raise SystemExit(f"memfit {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    return json.load(open(report))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", default="768MiB")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "s3-memory.json"))
    args = ap.parse_args(argv)

    from memfit.memory.sizes import parse_size

    budget = parse_size(args.budget)
    text = real_text()
    server, env = start_s3()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as workdir:
            step = (len(text) - 2_000) // 200
            jobs = {
                "embed --tokens, 300k chars": (
                    write_jsonl(os.path.join(workdir, "doc.jsonl"), [text[:300_000]]),
                    ["--tokens"],
                ),
                "embed pooled, 200 x 2k chars": (
                    write_jsonl(
                        os.path.join(workdir, "spans.jsonl"), [text[i * step : i * step + 2_000] for i in range(200)]
                    ),
                    [],
                ),
            }
            peaks: dict[tuple[str, str], list[float]] = {}
            for run in range(args.runs):
                for number, (job, (source, extra)) in enumerate(jobs.items()):
                    for where in ("local", "s3"):
                        out = (
                            os.path.join(workdir, f"out-{run}-{number}")
                            if where == "local"
                            else f"s3://out/r{run}-{number}"
                        )
                        command = [
                            "embed",
                            source,
                            "-o",
                            out,
                            "--model",
                            corpus.model_path(),
                            "--memory-budget",
                            args.budget,
                            *extra,
                        ]
                        report = peak_run(command, env, workdir)
                        peaks.setdefault((job, where), []).append(report["peak_bytes"] / MiB)
            for (job, where), values in peaks.items():
                rows.append(
                    {
                        "job": job,
                        "output": where,
                        "budget_mib": budget / MiB,
                        "peaks_mib": [round(v, 1) for v in values],
                        "max_peak_mib": max(values),
                        "over": sum(v * MiB > budget for v in values),
                    }
                )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)

    machine = _measure.machine_facts()
    print(f"# {machine['cpu_model']} ({', '.join(machine['cpu_flags_of_interest'])}), budget {args.budget}")
    _measure.print_table(
        rows,
        [
            ("job", "job", ""),
            ("output", "output", ""),
            ("peaks_mib", "peaks (MiB)", lambda v: ", ".join(f"{x:.1f}" for x in v)),
            ("max_peak_mib", "max", ".1f"),
            ("over", "over budget", ""),
        ],
    )
    _measure.write_json(args.out, {"machine": machine, "budget": args.budget, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
