"""Embed-job benchmark: memfit vs sentence-transformers ``encode`` vs the tutorial approach.

    python benchmarks/bench_embed.py [--n 2000] [--seed 0] [--out benchmarks/results/embed.json]
                                     [--methods st,tutorial,memfit-fp32,memfit-auto,memfit-auto-chunk]

Same data for every method (``corpus.long_tail_corpus(n, seed)``), one run each, every method in
its own fresh subprocess (clean peak RSS). Timed part = tokenization + forward + pooling of
all texts; model load and one tiny warm-up call are timed separately (``load_s``).
Quality: cosine of each method's pooled embedding vs the sentence-transformers fp32 embedding
of the same text, computed in the parent from the ``.npy`` each worker saves.
Not a test: it prints a table and writes JSON. See benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

MAX_LEN = 512
WARMUP_TEXTS = ["A short warm-up sentence.", "Another one, slightly longer than the first."]

# key -> (label, max tokens fed per text (None = every token))
METHODS: dict[str, tuple[str, int | None]] = {
    "st": ("sentence-transformers encode fp32 (batch 32, max_seq_length 512)", MAX_LEN),
    "tutorial": ("tutorial: pad to 512, batch 16, keep last_hidden_state", MAX_LEN),
    "memfit-fp32": ("memfit fp32 (truncate 512)", MAX_LEN),
    "memfit-auto": ("memfit auto dtype (truncate 512)", MAX_LEN),
    "memfit-auto-chunk": ("memfit auto dtype (chunk: every token)", None),
}
REFERENCE = "st"


# ============================================================================ worker side
# Each loader returns (encode(texts) -> embeddings, info dict). Everything inside encode is
# timed; everything in the loader (plus one warm-up encode) is load time.


def _load_st():
    from corpus import model_path

    model = _measure.sentence_transformer(model_path(), max_seq_length=MAX_LEN)

    def encode(texts):
        return _measure.st_encode(model, texts)

    return encode, {"batch_size": _measure.ST_BATCH_SIZE, "max_seq_length": model.max_seq_length}


def _load_tutorial():
    """The approach of many tutorials: pad everything to 512, keep all hidden states."""
    import torch
    from corpus import model_path
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    model = AutoModel.from_pretrained(model_path())
    model.eval()
    info: dict = {"batch_size": 16}

    def encode(texts):
        enc = tokenizer(texts, padding="max_length", max_length=MAX_LEN, truncation=True, return_tensors="pt")
        info["tokens_fed_check"] = int(enc["attention_mask"].sum())  # non-padding tokens
        dataset = TensorDataset(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
        loader = DataLoader(dataset, batch_size=16)
        hidden_states, masks = [], []
        with torch.no_grad():
            for input_ids, attention_mask, token_type_ids in loader:
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    token_type_ids=token_type_ids,
                )
                hidden_states.append(out.last_hidden_state)
                masks.append(attention_mask)
        hidden = torch.cat(hidden_states)  # (n, 512, 384) fp32
        mask = torch.cat(masks).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return pooled.numpy()

    return encode, info


def _load_memfit(dtype: str, long: str):
    def load():
        import memfit

        memfit.configure_process("cpu")  # what the memfit command does before loading a model
        encoder = memfit.Encoder(dtype=dtype, max_length=MAX_LEN)

        def encode(texts):
            return encoder.embed(texts, pooling="mean", long=long)

        info = {"dtype_requested": dtype, "long": long}
        for attr in ("dtype", "resolved_dtype", "effective_dtype"):
            v = getattr(encoder, attr, None)
            if v is not None and not callable(v):
                info["encoder_" + attr] = str(v)
        return encode, info

    return load


LOADERS = {
    "st": _load_st,
    "tutorial": _load_tutorial,
    "memfit-fp32": _load_memfit("fp32", "truncate"),
    "memfit-auto": _load_memfit("auto", "truncate"),
    "memfit-auto-chunk": _load_memfit("auto", "chunk"),
}


def _as_array(result):
    """Embeddings as a float32 (n, dim) numpy array, whatever container the method returns."""
    import numpy as np

    for attr in ("embeddings", "vectors", "pooled"):
        if hasattr(result, attr) and not callable(getattr(result, attr)):
            result = getattr(result, attr)
            break
    if hasattr(result, "detach"):  # torch tensor (maybe bf16)
        result = result.detach().float().cpu().numpy()
    if isinstance(result, list) and result and hasattr(result[0], "detach"):
        result = [r.detach().float().cpu().numpy() for r in result]
    return np.asarray(result, dtype=np.float32)


def run_worker(method: str, corpus_path: str, emb_out: str, report_path: str) -> None:
    import numpy as np
    import torch

    with open(corpus_path) as f:
        texts = json.load(f)["texts"]
    with _measure.Stopwatch() as load_sw:
        encode, info = LOADERS[method]()
        encode(list(WARMUP_TEXTS))
    rss_after_load = _measure.rss_now_mib()
    load_before = os.getloadavg()[0]
    with _measure.Stopwatch() as sw:
        result = encode(texts)
    load_after = os.getloadavg()[0]
    emb = _as_array(result)
    if emb.shape[0] != len(texts):
        raise RuntimeError(f"{method}: got {emb.shape[0]} embeddings for {len(texts)} texts")
    np.save(emb_out, emb)
    del result, emb
    _measure.worker_report(
        report_path,
        seconds=round(sw.seconds, 3),
        cpu_seconds=round(sw.cpu_seconds, 3),
        loadavg_1min_before=round(load_before, 2),
        loadavg_1min_after=round(load_after, 2),
        load_seconds=round(load_sw.seconds, 3),
        rss_after_load_mib=round(rss_after_load, 1),
        torch_threads=torch.get_num_threads(),
        **info,
    )


# ============================================================================ parent side


def _quality(rows: list[dict], emb_paths: dict[str, str], lengths: list[int]) -> None:
    import numpy as np

    ref_path = emb_paths.get(REFERENCE)
    if not ref_path or not os.path.exists(ref_path):
        return
    ref = np.load(ref_path)
    ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    short = np.asarray(lengths) <= MAX_LEN
    for row in rows:
        p = emb_paths.get(row["key"])
        if row.get("error") or not p or not os.path.exists(p):
            continue
        e = np.load(p)
        if e.shape != ref.shape:
            row["cos_note"] = f"shape {e.shape} != reference {ref.shape}"
            continue
        cos = (e / np.linalg.norm(e, axis=1, keepdims=True) * ref).sum(axis=1)
        row["cos_vs_st_mean"] = float(cos.mean())
        row["cos_vs_st_min"] = float(cos.min())
        if short.any():
            row["cos_vs_st_min_le512"] = float(cos[short].min())
        if (~short).any():
            row["cos_vs_st_min_gt512"] = float(cos[~short].min())


def _ratios(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["key"] == REFERENCE and r.get("tokens_per_s")), None)
    if ref is None:
        return
    for r in rows:
        if r.get("tokens_per_s"):
            r["tokens_per_s_vs_st"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
            r["texts_per_s_vs_st"] = round(r["texts_per_s"] / ref["texts_per_s"], 3)
            r["peak_rss_vs_st"] = round(r["peak_rss_mib"] / ref["peak_rss_mib"], 3)


COLUMNS = [
    ("method", "method", ""),
    ("real_tokens", "real tok", ","),
    ("tokens_covered_fraction", "covered", ".1%"),
    ("load_seconds", "load s", ".1f"),
    ("seconds", "encode s", ".1f"),
    ("tokens_per_s", "tok/s", ",.0f"),
    ("tokens_per_s_vs_st", "x ST", ".2f"),
    ("texts_per_s", "texts/s", ".2f"),
    ("cpu_seconds", "cpu s", ".0f"),
    ("loadavg_1min_after", "load", ".1f"),
    ("peak_rss_mib", "peak RSS MiB", ",.0f"),
    ("cos_vs_st_mean", "cos mean", ".4f"),
    ("cos_vs_st_min", "cos min", ".4f"),
    ("cos_vs_st_min_le512", "min<=512", ".4f"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memfit embed benchmark (not a test)")
    ap.add_argument("--n", type=int, default=2000, help="number of texts (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "embed.json"))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated keys")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per method")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=300,
        metavar="SECONDS",
        help="before each row wait up to this long for other processes to leave "
        "the CPUs idle (<25%% busy); 0 = don't wait (default 300)",
    )
    ap.add_argument("--keep-embeddings", metavar="DIR", help="save each method's .npy here")
    # internal (worker mode)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prepare-corpus", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--emb-out", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.prepare_corpus:
        import corpus

        corpus.write_corpus(args.prepare_corpus, args.n, args.seed)
        return 0
    if args.worker:
        run_worker(args.worker, args.corpus, args.emb_out, args.report)
        return 0

    keys = [k.strip() for k in args.methods.split(",") if k.strip()]
    unknown = [k for k in keys if k not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {list(METHODS)}")

    workdir = args.keep_embeddings or tempfile.mkdtemp(prefix="memfit-bench-")
    os.makedirs(workdir, exist_ok=True)
    corpus_path = os.path.join(workdir, "corpus.json")
    subprocess.run(
        [sys.executable, __file__, "--prepare-corpus", corpus_path, "--n", str(args.n), "--seed", str(args.seed)],
        check=True,
    )
    with open(corpus_path) as f:
        data = json.load(f)
    lengths: list[int] = data["lengths"]
    stats = data["stats"]
    del data
    total = sum(lengths)
    print(
        f"corpus: {stats['n']} texts, {total:,} tokens, median {stats['median']}, "
        f"p80 {stats['p80']}, {stats['pct_over_512']}% > 512, max {stats['max']}",
        flush=True,
    )

    rows: list[dict] = []
    emb_paths: dict[str, str] = {}
    for key in keys:
        label, max_tokens = METHODS[key]
        emb_paths[key] = os.path.join(workdir, f"{key}.npy")
        report_path = os.path.join(workdir, f"{key}.json")
        for p in (emb_paths[key], report_path):
            if os.path.exists(p):
                os.remove(p)
        quiet = _measure.wait_for_quiet_cpu(args.wait_quiet) if args.wait_quiet > 0 else {}
        print(f"running: {label} ...", flush=True)
        report = _measure.run_in_subprocess(
            [
                sys.executable,
                __file__,
                "--worker",
                key,
                "--corpus",
                corpus_path,
                "--emb-out",
                emb_paths[key],
                "--report",
                report_path,
            ],
            report_path,
            timeout=args.timeout,
        )
        real = sum(lengths) if max_tokens is None else sum(min(n, max_tokens) for n in lengths)
        row = _measure.throughput_row(label, report, texts=len(lengths), real_tokens=real, total_tokens=total)
        row["key"] = key
        row.update(quiet)
        row["max_tokens_per_text"] = max_tokens
        rows.append(row)
        done = row.get("error") or (
            f"{row['seconds']:.1f} s, {row['tokens_per_s']:,.0f} tok/s, peak RSS {row['peak_rss_mib']:,.0f} MiB"
        )
        print(f"  -> {done}", flush=True)

    _quality(rows, emb_paths, lengths)
    _ratios(rows)
    print()
    _measure.print_table(rows, COLUMNS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    busiest = max((r.get("loadavg_1min_after") or 0 for r in rows), default=0)
    if busiest > cores + 0.5:
        print(
            f"WARNING: 1-min load average reached {busiest:.1f} on {cores} cores: other "
            "processes competed for the CPU, so timings are inflated (see 'cpu s')."
        )
    payload = {
        "benchmark": "embed",
        "args": {"n": args.n, "seed": args.seed, "methods": keys, "max_length": MAX_LEN},
        "corpus": {"generator": "benchmarks/corpus.py:long_tail_corpus", **stats},
        "reference_for_cos_and_ratios": METHODS[REFERENCE][0],
        "rows": rows,
    }
    out = _measure.write_json(args.out, payload)
    print(f"\nwrote {out}")
    if not args.keep_embeddings:
        for p in list(emb_paths.values()) + [corpus_path]:
            if os.path.exists(p):
                os.remove(p)
        for key in keys:
            p = os.path.join(workdir, f"{key}.json")
            if os.path.exists(p):
                os.remove(p)
        try:
            os.rmdir(workdir)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
