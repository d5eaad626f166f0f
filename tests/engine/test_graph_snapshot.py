"""A run on a cached compiled graph without transformers or torch: the tokenizer and config written beside the graph
(engine/graph_snapshot.py) against transformers' own, and a whole run that imports neither torch, transformers nor
pandas yet writes the vectors of a run that did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from memfit import Classifier, Reranker
from memfit.engine.graph_snapshot import load_snapshot, load_snapshot_config, save_snapshot
from memfit.jobs.classify_scores import read_classifications
from conftest import memfit_imports, sharing_graphs

pytest.importorskip("openvino")

TRICKY = [
    "Crème brûlée costs €5 — a naïve façade, isn't it?",
    "北京大学的学生在图书馆里读书。",
    "emoji 😀 and\ttabs and\nnewlines",
    "",
    "   leading and trailing spaces   ",
    "UPPER lower MiXeD 12,345.67 [brackets] (parens) {braces} http://example.com/a?b=c",
    "a" * 300,
]


def _lee_texts() -> list[str]:
    from gensim.test.utils import datapath

    lines = open(datapath("lee.cor"), "rb").read().decode("latin-1").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip()][:30]


def _never(what: str):
    def fail():
        raise AssertionError(f"the snapshot should have answered without loading transformers' {what}")

    return fail


@pytest.fixture(params=["minilm", "tiny"])
def model_dir(request, minilm_dir, tiny_model_dir) -> str:
    return minilm_dir if request.param == "minilm" else tiny_model_dir


def test_the_snapshot_tokenizer_gives_transformers_tokens_offsets_and_facts(model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    reference = AutoTokenizer.from_pretrained(model_dir)
    save_snapshot(tmp_path, reference, AutoConfig.from_pretrained(model_dir))
    tokenizer, config = load_snapshot(tmp_path, _never("tokenizer"), _never("config"))
    texts = _lee_texts() + TRICKY
    # the call memfit tokenizes with (data/tokenization.py): content tokens and their character offsets
    options = dict(
        add_special_tokens=False,
        truncation=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    got, expected = tokenizer(texts, **options), reference(texts, **options)
    assert got["input_ids"] == expected["input_ids"]
    ids = expected["input_ids"][0]
    assert [[tuple(o) for o in row] for row in got["offset_mapping"]] == [
        [tuple(o) for o in row] for row in expected["offset_mapping"]
    ]
    # the calls that find the special tokens' template (data/chunking.py)
    for args in (("a",), ("a", "b"), (texts[0], TRICKY[1])):
        options = dict(add_special_tokens=True, return_special_tokens_mask=True, return_token_type_ids=True)
        got, expected = tokenizer(*args, **options), reference(*args, **options)
        for field in ("input_ids", "special_tokens_mask", "token_type_ids", "attention_mask"):
            assert got[field] == expected[field], (args, field)
    assert tokenizer.model_input_names == reference.model_input_names
    assert tokenizer.pad_token_id == reference.pad_token_id
    assert tokenizer.model_max_length == reference.model_max_length
    for pair in (False, True):
        assert tokenizer.num_special_tokens_to_add(pair=pair) == reference.num_special_tokens_to_add(pair=pair)
    assert tokenizer.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == reference.convert_ids_to_tokens(ids[0])
    reference_config = AutoConfig.from_pretrained(model_dir)
    for name in ("hidden_size", "num_hidden_layers", "max_position_embeddings", "pad_token_id", "model_type"):
        assert getattr(config, name) == getattr(reference_config, name), name


def test_what_the_snapshot_does_not_hold_comes_from_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference_config = AutoConfig.from_pretrained(tiny_model_dir)
    save_snapshot(tmp_path, reference, reference_config)
    tokenizer, config = load_snapshot(
        tmp_path, lambda: AutoTokenizer.from_pretrained(tiny_model_dir), lambda: reference_config
    )
    ids = reference("the cat sat on the mat")["input_ids"]
    assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.get_vocab() == reference.get_vocab()
    assert config.use_return_dict == reference_config.use_return_dict  # a property, not a stored value


def test_a_classifiers_config_reads_back_as_transformers_reads_it(tiny_model_dir, tmp_path):
    """A classifier's labels come back keyed by class index (JSON stores the keys as strings) with their count, a
    config holding a standard name under its own (DistilBERT's ``dim`` for ``hidden_size``: transformers'
    ``attribute_map``) answers it without loading transformers, and a name the config lacks altogether (DistilBERT's
    ``intermediate_size``, which the memory model reads with a default) is missing without loading it either."""
    from transformers import AutoTokenizer, BertConfig, DistilBertConfig

    labels = {0: "contradiction", 1: "neutral", 2: "entailment"}
    configs = {
        "bert": BertConfig(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}),
        "distilbert": DistilBertConfig(dim=48, n_heads=4, n_layers=2, problem_type="single_label_classification"),
    }
    configs["bert"].architectures = ["BertForSequenceClassification"]
    for name, reference in configs.items():
        (tmp_path / name).mkdir()
        save_snapshot(tmp_path / name, AutoTokenizer.from_pretrained(tiny_model_dir), reference)
        config = load_snapshot_config(tmp_path / name, _never("config"))
        assert config is not None
        for attribute in ("id2label", "label2id", "num_labels", "architectures", "problem_type", "model_type"):
            assert getattr(config, attribute) == getattr(reference, attribute), (name, attribute)
        for attribute in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
            assert getattr(config, attribute) == getattr(reference, attribute), (name, attribute)
        for attribute in ("intermediate_size", "max_position_embeddings", "vocab_size", "pad_token_id", "no_such"):
            assert getattr(config, attribute, "missing") == getattr(reference, attribute, "missing"), (name, attribute)
    assert configs["distilbert"].hidden_size == 48  # the alias is what the test checks
    assert not hasattr(configs["distilbert"], "intermediate_size")  # the missing name is what the test checks


def test_a_snapshot_of_another_format_or_damaged_is_not_used(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    save_snapshot(tmp_path, AutoTokenizer.from_pretrained(tiny_model_dir), AutoConfig.from_pretrained(tiny_model_dir))
    path = tmp_path / "loading-snapshot.json"
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "format": 0}))
    assert load_snapshot(tmp_path, _never("tokenizer"), _never("config")) is None
    path.write_text(path.read_text()[:100])
    assert load_snapshot(tmp_path, _never("tokenizer"), _never("config")) is None


def test_the_config_alone_is_read_without_building_the_tokenizer(tiny_model_dir, tmp_path):
    # classify reads the config to choose its mode, then loads the runtime, which builds the tokenizer: the config's
    # read must not build it too. A tokenizer tokenizers cannot read shows whether it did
    from transformers import AutoConfig, AutoTokenizer

    reference_config = AutoConfig.from_pretrained(tiny_model_dir)
    save_snapshot(tmp_path, AutoTokenizer.from_pretrained(tiny_model_dir), reference_config)
    path = tmp_path / "loading-snapshot.json"
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "tokenizer": {**stored["tokenizer"], "backend": "not a tokenizer"}}))
    assert load_snapshot(tmp_path, _never("tokenizer"), _never("config")) is None
    config = load_snapshot_config(tmp_path, _never("config"))
    assert config is not None
    for name in ("hidden_size", "num_hidden_layers", "max_position_embeddings", "vocab_size", "model_type"):
        assert getattr(config, name) == getattr(reference_config, name), name
    path.write_text(json.dumps({**stored, "format": 0}))
    assert load_snapshot_config(tmp_path, _never("config")) is None


@pytest.mark.slow
def test_a_run_on_the_cached_graph_imports_neither_torch_transformers_nor_pandas_and_writes_the_same_vectors(
    tiny_model_dir, tmp_path
):
    import memfit

    data = tmp_path / "texts.jsonl"
    texts = _lee_texts()[:12] + TRICKY
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(tmp_path / "cache")}  # the first run converts the graph
    imported = []
    for name in ("first", "second"):
        out = tmp_path / name
        args = ["embed", str(data), "-o", str(out), "--model", tiny_model_dir, "--dtype", "fp32", "--tokens"]
        args += ["--memory-budget", "2GiB"]  # an explicit budget: the offload check reads the checkpoint's header
        imported.append(memfit_imports(args, env))
    assert "transformers" in imported[0]  # tokenized by transformers, graph converted: the reference
    assert imported[1] == []
    # zero-shot classification in embedding mode (what ``memfit serve`` builds at start) chooses its mode from the
    # config cached beside the graph, and runs on the graph too
    args = ["classify", str(data), "-o", str(tmp_path / "classified"), "--model", tiny_model_dir, "--dtype", "fp32"]
    args += ["--labels", "sports,politics,science"]
    assert not {"torch", "transformers"} & set(memfit_imports(args, env))
    ids, classifications = read_classifications(tmp_path / "classified")
    assert ids == list(range(len(texts))) and all(len(c.labels) == 3 for c in classifications)
    first, second = memfit.read(tmp_path / "first"), memfit.read(tmp_path / "second")
    np.testing.assert_array_equal(first.embeddings, second.embeddings)
    assert len(first.token_ids) == len(texts)
    for field in ("token_ids", "token_offsets", "token_embeddings"):
        for a, b in zip(getattr(first, field), getattr(second, field), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_classifier_on_its_cached_graph_imports_neither_torch_nor_transformers_and_scores_as_pytorch(
    tiny_nli_dir, tiny_cross_encoder_dirs, tmp_path
):
    """A sequence classifier's graph (its logits) keeps the tokenizer and config beside it too: NLI zero-shot, the
    model's own labels (``id2label``, whose keys JSON stores as strings) and a cross-encoder's rerank scores from that
    snapshot, against transformers' tokenizer and PyTorch's forward in this process."""
    data = tmp_path / "texts.jsonl"
    texts = _lee_texts()[:8] + TRICKY
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    # the session's graphs (the fixture converted this one): the first run writes the snapshot if no test did
    env = {**os.environ, "MEMFIT_CACHE_DIR": str(sharing_graphs(tmp_path / "cache"))}

    def run(job: str, name: str, model: str, *extra: str) -> list[str]:
        args = [job, str(data), "-o", str(tmp_path / name), "--model", model, "--dtype", "fp32"]
        return memfit_imports([*args, "--backend", "openvino", *extra], env)

    labels = ["sports", "politics", "science"]
    run("classify", "first", tiny_nli_dir, "--labels", ",".join(labels))
    assert not {"torch", "transformers"} & set(run("classify", "zero-shot", tiny_nli_dir, "--labels", ",".join(labels)))
    assert not {"torch", "transformers"} & set(run("classify", "own-labels", tiny_nli_dir, "--mode", "supervised"))
    cross_encoder, query = tiny_cross_encoder_dirs["two_class"], "where does the cat sleep"
    run("rerank", "first-rerank", cross_encoder, "--query", query)
    assert not {"torch", "transformers"} & set(run("rerank", "rerank", cross_encoder, "--query", query))

    reranked = pq.read_table(tmp_path / "rerank" / "part-00000.parquet").column("score").to_numpy()
    expected = Reranker(cross_encoder, dtype="fp32", backend="torch").score([(query, t) for t in texts])
    np.testing.assert_allclose(reranked, expected, atol=1e-5)

    for name, mode, asked in (("zero-shot", "nli", labels), ("own-labels", "supervised", None)):
        reference = Classifier(tiny_nli_dir, dtype="fp32", backend="torch", mode=mode).classify(texts, labels=asked)
        ids, got = read_classifications(tmp_path / name)
        assert ids == list(range(len(texts)))
        for ours, theirs in zip(got, reference, strict=True):
            assert sorted(ours.labels) == sorted(theirs.labels)  # the labels asked for, or the model's names
            expected = dict(zip(theirs.labels, theirs.scores))
            np.testing.assert_allclose(ours.scores, [expected[label] for label in ours.labels], atol=1e-5)


def test_transformers_imported_after_configure_process_is_quiet():
    """configure_process quiets transformers without importing it: from its first import on. What waits for a
    module's import leaves once it has run, and a second call adds no second one (pyarrow's, not imported here,
    waits once)."""
    probe = (
        "import sys, memfit\n"
        "memfit.configure_process('cpu')\n"
        "print('transformers' in sys.modules)\n"
        "from transformers.utils import logging\n"
        "print(logging.get_verbosity() == logging.ERROR, logging.is_progress_bar_enabled())\n"
        "memfit.configure_process('cpu')\n"
        "print(','.join(f.module_name for f in sys.meta_path if type(f).__name__ == '_ConfigureOnImport'))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "False", "pyarrow"]


def test_calls_memfit_does_not_make_are_answered_by_transformers(tiny_model_dir, tmp_path):
    """Code holding ``Encoder.tokenizer`` may call it as a transformers tokenizer: truncation, padding, tensors."""
    from transformers import AutoConfig, AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    save_snapshot(tmp_path, reference, AutoConfig.from_pretrained(tiny_model_dir))
    tokenizer, _ = load_snapshot(tmp_path, lambda: AutoTokenizer.from_pretrained(tiny_model_dir), _never("config"))
    text = " ".join(["the cat sat on the mat"] * 40)
    for options in (
        dict(truncation=True, max_length=16),
        dict(padding="max_length", max_length=8, truncation=True),
        dict(padding=True, return_tensors="np"),
    ):
        got, expected = tokenizer([text, "a dog"], **options), reference([text, "a dog"], **options)
        for field in expected:
            np.testing.assert_equal(got[field], expected[field])
