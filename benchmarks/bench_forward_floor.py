"""The speed floor under the embed benchmark: bare transformers forwards over length-sorted batches.

    python benchmarks/bench_forward_floor.py [--n 2000] [--caps 2048,4096] [--dtype fp32]
                                             [--texts long-tail|short] [--out benchmarks/results/forward_floor.json]

``long-tail`` (default): the same corpus and max_length 512 as ``bench_embed.py``. ``short``: the
movie-review sentences ``bench_serve.py`` sends as its short texts (repeated up to ``--n``), the
ceiling under any server's texts/s on them. The texts are tokenized once (untimed), sorted
by token length and cut into batches of at most CAP padded tokens (lengths padded to a multiple of 8,
as memfit's planner counts them; memfit's CPU inference now runs the exact width); the timed part is
only the model's forwards plus a mean over the sequence axis. No tokenization, no pooling mask, no
output: what is left of memfit's time above this is its own cost, and a batching scheme cannot beat it.
Not a test: it prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _measure  # noqa: E402

MAX_LEN = 512
PAD_MULTIPLE = 8


def _batches(lengths: list[int], cap: int) -> list[list[int]]:
    """Indices sorted by length, cut so batch size x padded length stays within ``cap``."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = [[]]
    for i in order:
        padded = -(-lengths[i] // PAD_MULTIPLE) * PAD_MULTIPLE  # sorted: the newest text is the longest
        if batches[-1] and (len(batches[-1]) + 1) * padded > cap:
            batches.append([])
        batches[-1].append(i)
    return batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caps", default="2048,4096", help="padded tokens per batch, comma-separated")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--texts", choices=("long-tail", "short"), default="long-tail")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "forward_floor.json"))
    args = ap.parse_args()

    import torch
    from corpus import long_tail_corpus, model_path
    from transformers import AutoModel, AutoTokenizer

    if args.texts == "short":
        from bench_serve import short_texts

        sentences = short_texts()
        texts = [sentences[i % len(sentences)] for i in range(args.n)]
    else:
        texts = long_tail_corpus(args.n, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModel.from_pretrained(model_path(), attn_implementation="sdpa", dtype=dtype).eval()
    ids = tokenizer(texts, truncation=True, max_length=MAX_LEN)["input_ids"]
    lengths = [len(x) for x in ids]
    rows = []
    for cap in (int(c) for c in args.caps.split(",")):
        batches = _batches(lengths, cap)
        padded = 0
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                width = -(-max(lengths[i] for i in batch) // PAD_MULTIPLE) * PAD_MULTIPLE
                input_ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for row, i in enumerate(batch):
                    input_ids[row, : lengths[i]] = torch.tensor(ids[i])
                    mask[row, : lengths[i]] = 1
                model(input_ids=input_ids, attention_mask=mask).last_hidden_state.mean(1)
                padded += width * len(batch)
        seconds = time.perf_counter() - started
        rows.append(
            {
                "method": f"bare forward, {args.dtype}, cap {cap}",
                "cap": cap,
                "batches": len(batches),
                "texts_per_s": round(len(texts) / seconds, 1),
                "real_tokens": sum(lengths),
                "padding": padded / sum(lengths) - 1,
                "seconds": round(seconds, 1),
                "tok_s": round(sum(lengths) / seconds),
            }
        )
        print(f"cap {cap}: {seconds:.1f} s", file=sys.stderr, flush=True)
    _measure.print_table(
        rows,
        [
            ("method", "method", ""),
            ("batches", "batches", ""),
            ("real_tokens", "real tokens", ","),
            ("padding", "padding", ".1%"),
            ("seconds", "forward s", ".1f"),
            ("tok_s", "real tok/s", ","),
            ("texts_per_s", "texts/s", ".1f"),
        ],
    )
    print("wrote", _measure.write_json(args.out, {"benchmark": "forward_floor", "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
