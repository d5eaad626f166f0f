"""Ray Data + memfit vs Ray Data's documented embedding pattern, on the same CPUs and texts.

    flock /tmp/memfit-bench.lock python benchmarks/bench_ray.py [--n 1024] [--workers 2]

Both methods embed the same real texts (``corpus.long_tail_corpus``: median ~150 MiniLM tokens, ~20%
over 512, 1% ~3,000) with the bundled all-MiniLM-L6-v2 on a local Ray cluster of ``--workers`` CPUs,
each in a fresh process (cluster start excluded from the time, model loading in the workers included):

* ``memfit``: ``memfit.ray.embed_to`` on a Parquet file: ``--workers`` actors, each within
  ``--budget``, one part per ``--part-size`` rows, long texts covered by windows (every token).
* ``memfit-truncate``: the same with ``long="truncate"``: the first 256-token window of each text,
  the tokens the documented pattern sees, for a like-for-like speed comparison.
* ``documented``: Ray Data's pattern: ``read_parquet → map_batches(Embedder, concurrency=workers,
  batch_size=--rows) → write_parquet``, where ``Embedder`` is a sentence-transformers callable class
  (``model.encode(texts)``: 32 texts per forward, truncated at 256 tokens).

``--output s3``: memfit's methods write to a bucket of a moto S3 server started on 127.0.0.1 (as
``bench_s3_memory.py`` starts it) instead of a local directory: the workers upload their parts.

Measured: texts/s, each worker's peak RSS (VmHWM, read by the worker after each batch) and the share of
the corpus's tokens that reached the model. The CPU load of other processes is sampled before each run
and reported: speed figures from a shared machine are only as good as that number.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _measure  # noqa: E402


def _record_peak(folder: str) -> None:
    """Write this worker process's peak RSS (memfit's resets of VmHWM folded in) to ``folder``."""
    path = os.path.join(folder, f"peak-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(_measure.peak_rss(), f)
    os.replace(path + ".tmp", path)


def _memfit_worker_class(peaks: str):
    from memfit.ray.worker import PartWorker

    class MeasuredPartWorker(PartWorker):
        def __call__(self, batch):
            out = super().__call__(batch)
            _record_peak(peaks)
            return out

    return MeasuredPartWorker


class DocumentedEmbedder:
    """Ray Data's documented callable class around sentence-transformers."""

    def __init__(self, model_path: str, peaks: str):
        self.model = _measure.sentence_transformer(model_path)
        self.peaks = peaks

    def __call__(self, batch: dict) -> dict:
        batch["embedding"] = _measure.st_encode(self.model, batch["text"])
        _record_peak(self.peaks)
        return batch


def run_method(method: str, args: argparse.Namespace, work: str) -> dict:
    import ray
    import ray.data

    import corpus

    peaks = os.path.join(work, f"peaks-{method}")
    os.makedirs(peaks)
    # One logical CPU more than workers, for both methods: Ray Data's list / read / write tasks ask for a
    # whole CPU each and would otherwise wait forever behind the actors (the cores are the same)
    ray.init(
        num_cpus=args.workers + 1,
        object_store_memory=256 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.data.DataContext.get_current().enable_progress_bars = False
    source = os.path.join(work, "corpus.parquet")
    start = time.perf_counter()
    if method.startswith("memfit"):
        import memfit.ray

        long = "truncate" if method == "memfit-truncate" else "chunk"
        manifest = memfit.ray.embed_to(
            source,
            f"s3://out/{method}" if args.output == "s3" else os.path.join(work, f"out-{method}"),
            workers=args.workers,
            memory_budget=args.budget,
            part_size=args.part_size,
            long=long,
            worker_class=_memfit_worker_class(peaks),
        )
        rows = manifest["rows"]
    else:
        # as many blocks as batches: read_parquet makes one block of a small file, and one block goes to
        # one actor, which would leave the others idle (override_num_blocks did not split it)
        blocks = max(2 * args.workers, args.n // args.rows)
        ds = (
            ray.data.read_parquet(source)
            .repartition(blocks)
            .map_batches(
                DocumentedEmbedder,
                fn_constructor_kwargs={"model_path": corpus.model_path(), "peaks": peaks},
                concurrency=args.workers,
                batch_size=args.rows,
                num_cpus=0.9,
            )
        )
        ds.write_parquet(os.path.join(work, "out-documented"))
        rows = ray.data.read_parquet(os.path.join(work, "out-documented")).count()
    seconds = time.perf_counter() - start
    ray.shutdown()
    workers = [json.load(open(p))["peak_rss_mib"] for p in sorted(glob.glob(os.path.join(peaks, "*.json")))]
    return {"seconds": round(seconds, 2), "rows": rows, "worker_peak_rss_mib": workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024, help="texts (default: 1024)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", default="1GiB", help="memfit's --memory-budget per worker (default: 1GiB)")
    ap.add_argument("--part-size", type=int, default=128, help="memfit: rows per part (default: 128)")
    ap.add_argument("--rows", type=int, default=64, help="documented pattern: batch_size rows (default: 64)")
    ap.add_argument(
        "--methods",
        default="documented,memfit,memfit-truncate",
        help="memfit covers every token (--long chunk); memfit-truncate keeps the first window, "
        "as sentence-transformers does",
    )
    ap.add_argument("--output", choices=("local", "s3"), default="local", help="where memfit writes its parts")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per method (default: 1800)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ray.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        report = run_method(args.worker, args, args.work)
        _measure.worker_report(os.path.join(args.work, f"{args.worker}.json"), **report)
        return

    import corpus

    texts = corpus.long_tail_corpus(args.n)
    lengths = corpus.token_lengths(texts)
    total = sum(lengths)
    first_window = sum(min(n, 256) for n in lengths)  # MiniLM's max_seq_length, special tokens included
    covered = {"memfit": total, "memfit-truncate": first_window, "documented": first_window}
    rows = []
    server = None
    if args.output == "s3":
        from bench_s3_memory import start_s3

        server, credentials = start_s3()
        os.environ.update(credentials)  # the worker processes (and their Ray workers) inherit them
    with tempfile.TemporaryDirectory() as work:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # several row groups: read_parquet (the documented pattern) reads one per task, in parallel
        pq.write_table(pa.table({"text": texts}), os.path.join(work, "corpus.parquet"), row_group_size=128)
        for method in args.methods.split(","):
            load = _measure.cpu_busy_fraction(3.0)
            argv = [
                sys.executable,
                __file__,
                "--worker",
                method,
                "--work",
                work,
                "--n",
                str(args.n),
                "--workers",
                str(args.workers),
                "--budget",
                args.budget,
                "--part-size",
                str(args.part_size),
                "--rows",
                str(args.rows),
                "--output",
                args.output,
            ]
            report = _measure.run_in_subprocess(argv, os.path.join(work, f"{method}.json"), timeout=args.timeout)
            row = _measure.throughput_row(method, report, texts=args.n, real_tokens=covered[method], total_tokens=total)
            row["other_load_before"] = None if load is None else round(load, 2)
            rows.append(row)
    if server is not None:
        server.terminate()
        server.wait(timeout=30)
    budget_mib = _budget_mib(args.budget)
    print(
        f"\n{args.n} texts, {total:,} tokens; {args.workers} workers on a local Ray cluster; "
        f"memfit budget {args.budget} per worker, memfit output {args.output}"
    )
    print(f"{'method':<16}{'texts/s':>9}{'tokens covered':>16}{'worker peaks MiB':>22}{'CPU busy before':>17}")
    for row in rows:
        peaks = "/".join(f"{p:.0f}" for p in row.get("worker_peak_rss_mib", [])) or row.get("error", "")
        print(
            f"{row['method']:<16}{row.get('texts_per_s', float('nan')):>9.2f}{row['tokens_covered_fraction']:>16.1%}"
            f"{peaks:>22}{row['other_load_before'] if row['other_load_before'] is not None else '?':>17}"
        )
    by = {r["method"]: r for r in rows}
    for name in ("memfit", "memfit-truncate"):
        if "texts_per_s" in by.get(name, {}) and "texts_per_s" in by.get("documented", {}):
            speedup = by[name]["texts_per_s"] / by["documented"]["texts_per_s"]
            within = all(p <= budget_mib for p in by[name]["worker_peak_rss_mib"])
            by[name]["speedup_vs_documented"] = round(speedup, 3)
            print(f"{name} / documented: {speedup:.2f}x texts/s; every worker within its budget: {within}")
    _measure.write_json(
        args.out,
        {
            "benchmark": "ray",
            "n": args.n,
            "workers": args.workers,
            "budget": args.budget,
            "output": args.output,
            "part_size": args.part_size,
            "documented_batch_rows": args.rows,
            "total_tokens": total,
            "rows": rows,
        },
    )


def _budget_mib(budget: str) -> float:
    from memfit.memory.sizes import parse_size

    return parse_size(budget, 2**50) / 2**20


if __name__ == "__main__":
    main()
