"""``memfit.Reranker`` and ``memfit rerank``: scores equal sentence-transformers' ``CrossEncoder.predict``,
ranking and ``top_n``, long documents scored by their best window (against windows built by hand with the
tokenizer), the refusals, and the CLI's Parquet output with ``--resume``."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import memfit
from reference_outputs import DOCUMENTS, QUERIES, crossencoder_scores


@pytest.fixture(scope="module")
def rerankers(tiny_cross_encoder_dirs) -> dict[str, memfit.Reranker]:
    return {name: memfit.Reranker(path, dtype="fp32") for name, path in tiny_cross_encoder_dirs.items()}


@pytest.mark.parametrize("kind", ["one_logit", "two_class"])
def test_scores_equal_crossencoder_predict(rerankers, tiny_cross_encoder_dirs, kind):
    pairs = [(q, d) for q in QUERIES for d in DOCUMENTS]
    want = crossencoder_scores(tiny_cross_encoder_dirs[kind], pairs)
    got = rerankers[kind].score(pairs)
    assert got.dtype == np.float32 and got.shape == (len(pairs),)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.ptp(want) > 0.1  # the pairs are told apart, so equal scores mean something


def test_raw_scores_are_the_logit_or_the_log_odds(tiny_cross_encoder_dirs):
    """On PyTorch, the raw score is transformers' own logit to 1e-5. (OpenVINO's fp32 kernels sum in another
    order: on these large-weight models its logits of magnitude ~2-5 differ by up to 2.6e-5, its scores by
    less than 1e-5, which tests/engine/test_backends.py checks.)"""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pairs = [(q, d) for q in QUERIES[:2] for d in DOCUMENTS]
    for kind, path in tiny_cross_encoder_dirs.items():
        reranker = memfit.Reranker(path, dtype="fp32", backend="torch")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        with torch.no_grad():
            logits = model(
                **tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
            ).logits.numpy()
        want = logits[:, 0] if kind == "one_logit" else logits[:, 1] - logits[:, 0]
        np.testing.assert_allclose(reranker.score(pairs, raw=True), want, atol=1e-5, rtol=0)


def test_rank_orders_best_first_and_keeps_top_n(rerankers, tiny_cross_encoder_dirs):
    query = QUERIES[0]
    want = crossencoder_scores(tiny_cross_encoder_dirs["one_logit"], [(query, d) for d in DOCUMENTS])
    ranked = rerankers["one_logit"].rank(query, DOCUMENTS)
    assert [r.index for r in ranked] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    np.testing.assert_allclose([r.score for r in ranked], np.sort(want)[::-1], atol=1e-5)
    top = rerankers["one_logit"].rank(query, DOCUMENTS, top_n=2)
    assert top == ranked[:2]
    assert rerankers["one_logit"].rank(query, DOCUMENTS, top_n=100) == ranked
    with pytest.raises(memfit.ConfigError, match="top_n"):
        rerankers["one_logit"].rank(query, DOCUMENTS, top_n=0)


def test_a_long_document_scores_its_best_window(rerankers, tiny_cross_encoder_dirs):
    """A document over one window: windows built by hand (query + each overlapping chunk of the document's
    tokens, through the tokenizer's own pair template) run through plain transformers; the score is the
    maximum of theirs. truncate keeps only the first."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_cross_encoder_dirs["two_class"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    rng = np.random.default_rng(0)
    words = "the cat sat on the mat and the dog ran to the house in the city music film".split()
    document = " ".join(rng.choice(words, 300))
    query = "where is the cat"
    doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    query_ids = tokenizer(query, add_special_tokens=False)["input_ids"]
    room = 128 - 3 - len(query_ids)  # [CLS] query [SEP] chunk [SEP]
    stride = 16
    starts = list(range(0, len(doc_ids) - room, room - stride)) + [len(doc_ids) - room]
    assert len(starts) >= 3
    chunks = [tokenizer.decode(doc_ids[s : s + room]) for s in starts]
    inputs = tokenizer([query] * len(chunks), chunks, padding=True, return_tensors="pt")
    assert all(len(ids) - ids.count(0) <= 128 for ids in inputs["input_ids"].tolist())
    with torch.no_grad():
        probabilities = torch.softmax(model(**inputs).logits, dim=1)[:, 1].numpy()
    reranker = rerankers["two_class"]
    assert reranker.score([(query, document)], stride=stride)[0] == pytest.approx(probabilities.max(), abs=1e-5)
    assert reranker.score([(query, document)], long="truncate")[0] == pytest.approx(probabilities[0], abs=1e-5)
    assert np.ptp(probabilities) > 1e-3  # the windows disagree, so the maximum is a real choice


def test_a_model_that_is_not_a_cross_encoder_is_refused_before_loading(tiny_model_dir, tiny_nli_dir):
    with pytest.raises(memfit.ConfigError, match="not a cross-encoder"):
        memfit.Reranker(tiny_model_dir)
    with pytest.raises(memfit.ConfigError, match="3 classes"):
        memfit.Reranker(tiny_nli_dir)
    entailment = memfit.Reranker(tiny_nli_dir, positive_label="entailment", dtype="fp32")
    assert entailment.score([("a cat", "the cat sat")]).shape == (1,)


def test_a_query_longer_than_half_the_window_is_refused(rerankers):
    with pytest.raises(memfit.ConfigError, match="the query has"):
        rerankers["one_logit"].rank(" ".join(["cat"] * 80), DOCUMENTS)
    with pytest.raises(memfit.ConfigError, match=r"pairs\[1\]"):
        rerankers["one_logit"].score([("a", "b"), ("a",)])
    with pytest.raises(memfit.ConfigError, match="documents must be a list of strings, not one str"):
        rerankers["one_logit"].rank("a query", "one document")  # its characters were ranked


def test_the_command_asks_for_a_cross_encoder_instead_of_defaulting_to_the_bundled_embedding_model(tmp_path, capsys):
    """The bundled model is not a cross-encoder, so ``--model`` has no default for rerank: its help said it had."""
    from memfit.cli import build_parser

    documents = tmp_path / "docs.txt"
    documents.write_text("a cat\na dog\n")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["rerank", str(documents), "--query", "a pet", "-o", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "memfit rerank: error: the following arguments are required: --model"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rerank", "--help"])
    assert "bundled all-MiniLM-L6-v2 is not" in " ".join(capsys.readouterr().out.split())
    assert not (tmp_path / "out").exists()


def test_a_too_long_query_of_a_pair_file_names_its_file_line_and_field(tiny_cross_encoder_dirs, tmp_path, capsys):
    """Each record's own query is held to the same half window; the refusal points at the record, in one line
    (it was a TypeError traceback: the error was built without its file)."""
    from memfit.cli import main

    pairs = tmp_path / "pairs.jsonl"
    long_query = " ".join(["cat"] * 80)
    rows = [{"query": "a", "text": "b"}, {"query": long_query, "text": "c"}]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(memfit.InputError, match=r"pairs\.jsonl:2: field 'query': record 1: the query has 80 tokens"):
        memfit.Reranker(tiny_cross_encoder_dirs["one_logit"], dtype="fp32").rerank_to(pairs, tmp_path / "api")
    argv = ["rerank", str(pairs), "--model", tiny_cross_encoder_dirs["one_logit"], "--dtype", "fp32"]
    assert main([*argv, "-o", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert "pairs.jsonl:2: field 'query': record 1: the query has 80 tokens" in err and "Traceback" not in err, err


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_writes_scores_for_a_query_or_for_pairs_and_resumes(rerankers, tiny_cross_encoder_dirs, tmp_path):
    path = tiny_cross_encoder_dirs["one_logit"]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"doc": d, "key": f"d{i}"}) + "\n" for i, d in enumerate(DOCUMENTS)))
    out = tmp_path / "by-query"
    done = run_cli(
        "rerank",
        str(docs),
        "--query",
        QUERIES[0],
        "--document-field",
        "doc",
        "--id-field",
        "key",
        "--model",
        path,
        "--dtype",
        "fp32",
        "--part-size",
        "2",
        "-o",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    table = pq.read_table(sorted(out.glob("part-*.parquet"))[0])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == len(DOCUMENTS) and len(manifest["parts"]) == 3
    scores = np.concatenate([pq.read_table(out / p["file"]).column("score").to_numpy() for p in manifest["parts"]])
    assert table.column("id").to_pylist() == ["d0", "d1"]
    want = crossencoder_scores(path, [(QUERIES[0], d) for d in DOCUMENTS])
    np.testing.assert_allclose(scores, want, atol=1e-5)
    again = run_cli(
        "rerank",
        str(docs),
        "--query",
        QUERIES[0],
        "--document-field",
        "doc",
        "--id-field",
        "key",
        "--model",
        path,
        "--dtype",
        "fp32",
        "--part-size",
        "2",
        "-o",
        str(out),
        "--resume",
    )
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "manifest.json").read_text())["parts"] == manifest["parts"]

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"q": q, "d": d} for q in QUERIES for d in DOCUMENTS[:2]]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "pairs"
    done = run_cli(
        "rerank",
        str(pairs),
        "--query-field",
        "q",
        "--document-field",
        "d",
        "--model",
        path,
        "--dtype",
        "fp32",
        "-o",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    got = pq.read_table(out / "part-00000.parquet")
    want = crossencoder_scores(path, [(r["q"], r["d"]) for r in rows])
    np.testing.assert_allclose(got.column("score").to_numpy(), want, atol=1e-5)
    assert got.column("id").to_pylist() == list(range(len(rows)))


@pytest.mark.slow
def test_cli_refusals_name_the_field_or_the_model(tiny_cross_encoder_dirs, tiny_model_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "a", "text": "b"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    missing = run_cli("rerank", str(pairs), "--model", tiny_cross_encoder_dirs["one_logit"], "-o", str(tmp_path / "o1"))
    assert missing.returncode == 2 and "pairs.jsonl:2: field 'query'" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr
    wrong = run_cli("rerank", str(pairs), "--query", "x", "--model", tiny_model_dir, "-o", str(tmp_path / "o2"))
    assert wrong.returncode == 2 and "not a cross-encoder" in wrong.stderr, wrong.stderr
    assert not (tmp_path / "o2").exists()


def test_a_pair_classifier_trained_by_memfit_reranks_as_crossencoder_scores_it(tiny_model_dir, tmp_path):
    """`memfit train --text-pair-field` on (query, document, relevant?) rows saves a classifier that reranks: its
    scores equal CrossEncoder.predict's probability of the `relevant` class on the saved model."""
    from conftest import write_jsonl

    rows = [
        {"query": q, "document": d, "label": "relevant" if (i + j) % 2 == 0 else "irrelevant"}
        for i, q in enumerate(QUERIES[:2] + QUERIES[3:])
        for j, d in enumerate(DOCUMENTS)
        if d
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    memfit.train(
        data,
        tmp_path / "pair-model",
        tiny_model_dir,
        text_field="query",
        text_pair_field="document",
        epochs=1,
        batch_size=4,
        dtype="fp32",
    )
    reranker = memfit.Reranker(str(tmp_path / "pair-model"), dtype="fp32", positive_label="relevant")
    pairs = [(q, d) for q in QUERIES if q for d in DOCUMENTS if d]
    np.testing.assert_allclose(
        reranker.score(pairs), crossencoder_scores(str(tmp_path / "pair-model"), pairs), atol=1e-5
    )
