"""Prompts against sentence-transformers on a model whose config sets them (issue 35).

multilingual-e5-small (``../shared/tools/get-multilingual-e5-small.sh``) asks for ``query: `` and ``passage: ``
prompts; its config as the hub ships it names them in ``config_sentence_transformers.json``, which the script
does not write, so ``--with-prompts`` writes that file into a copy of the model (``query`` the default, as the hub
release has it). For each prompt (the default, each named one, none) memfit's vectors are compared with
``SentenceTransformer.encode`` on the same texts, and both are timed in one process, alternated.

    python benchmarks/bench_prompts.py --model "$(bash ../shared/tools/get-multilingual-e5-small.sh)" \\
        --with-prompts --n 1000 --out benchmarks/results/prompts.json

The model's 4-bit weights (dequantized) make its vectors differ from the hub release, not from
sentence-transformers on the same files: the comparison is exact either way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
from _measure import min_cosine, print_table, sentence_transformer, st_encode, write_json  # noqa: E402

E5_PROMPTS = {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"}


def with_prompts(model: str, work: Path) -> str:
    """A copy of ``model`` with e5's prompts in its sentence-transformers config."""
    target = work / "model-with-prompts"
    shutil.copytree(model, target, dirs_exist_ok=True)
    (target / "config_sentence_transformers.json").write_text(json.dumps(E5_PROMPTS))
    return str(target)


def best_of(rounds: int, action) -> tuple[float, np.ndarray]:
    best, result = float("inf"), None
    for _ in range(rounds):
        start = time.perf_counter()
        result = action()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a sentence-transformers model directory")
    parser.add_argument("--with-prompts", action="store_true", help="add e5's prompts to a copy of the model")
    parser.add_argument("--n", type=int, default=1000, help="texts (gensim's real documents, long-tail lengths)")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/prompts.json")
    args = parser.parse_args()

    import torch

    import memfit

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench-prompts-"))
    model = with_prompts(args.model, work) if args.with_prompts else args.model
    texts = corpus.long_tail_corpus(args.n, seed=0)
    st = sentence_transformer(model, max_seq_length=args.max_length)
    encoder = memfit.Encoder(model, device="cpu", dtype="fp32", max_length=args.max_length)
    config = Path(model) / "config_sentence_transformers.json"
    prompts = json.loads(config.read_text()).get("prompts", {}) if config.exists() else {}
    # None: each library's default; "": no prompt. The model's own prompts only: sentence-transformers adds empty
    # ones of its own (``document``) that the model's config does not name
    names = [None, *sorted(prompts), ""]
    normalize = any(type(module).__name__ == "Normalize" for module in st)  # as the model's pipeline ends
    rows = []
    references: dict[str, np.ndarray] = {}
    for name in names:
        label = "default" if name is None else (name or "none")
        # the same keywords mean the same in both: prompt_name, or prompt="" for none
        kwargs = {} if name is None else ({"prompt": ""} if name == "" else {"prompt_name": name})
        st_encode(st, texts[:32], **kwargs)  # warm-up
        encoder.embed(texts[:32], long="truncate", normalize=normalize, **kwargs)
        st_s, reference = best_of(args.rounds, lambda kw=kwargs: st_encode(st, texts, **kw))
        ours_s, ours = best_of(
            args.rounds, lambda kw=kwargs: encoder.embed(texts, long="truncate", normalize=normalize, **kw)
        )
        references[label] = reference
        rows.append(
            {
                "prompt": label,
                "min_cosine_vs_st": min_cosine(ours, reference),
                "max_abs_diff": float(np.abs(ours - reference).max()),
                "st_texts_per_s": len(texts) / st_s,
                "memfit_texts_per_s": len(texts) / ours_s,
                "ratio": st_s / ours_s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    for row in rows:  # a prompt that changed nothing would make the comparison above empty
        row["st_min_cosine_vs_no_prompt"] = min_cosine(references[row["prompt"]], references["none"])
    columns = [
        ("prompt", "prompt", ""),
        ("min_cosine_vs_st", "min cos vs ST", ".6f"),
        ("max_abs_diff", "max |diff|", ".2e"),
        ("st_texts_per_s", "ST fp32 texts/s", ".1f"),
        ("memfit_texts_per_s", "memfit fp32 texts/s", ".1f"),
        ("ratio", "ratio", ".2f"),
        ("st_min_cosine_vs_no_prompt", "ST: min cos vs no prompt", ".4f"),
    ]
    print_table(rows, columns)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    print(write_json(args.out, {"settings": settings, "prompts": prompts, "rows": rows}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
