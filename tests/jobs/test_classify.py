"""Zero-shot classification: NLI parity with transformers' pipeline, chunked aggregation, embedding mode
against sentence-transformers, the CLI end to end, and the errors users meet."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit.jobs.classify
from memfit import Classifier, ConfigError
from memfit.jobs.classify import read_classifications
from memfit.cli import main
from conftest import with_graphs

LABELS = ["cats", "dogs", "space science", "religion", "music", "a government story", "the market"]
WORDS = (
    "the cat dog space god science music film market city police movie story good bad happy sad "
    "hello world love hate time people new first"
).split()


def _texts(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths: a few words up to well past the fixture's 128-token window."""
    rng = random.Random(seed)
    lengths = [1, 3, 8, 20, 60, 150, 300]
    return [" ".join(rng.choice(WORDS) for _ in range(lengths[i % len(lengths)] + rng.randrange(3))) for i in range(n)]


@pytest.fixture(scope="module")
def nli(tiny_nli_dir) -> Classifier:
    return Classifier(tiny_nli_dir, dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def pipe(tiny_nli_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    model = AutoModelForSequenceClassification.from_pretrained(tiny_nli_dir, dtype=torch.float32)
    # batches of 16 (padded): the same scores as batch size 1 within 1e-7, several times faster
    return pipeline(
        "zero-shot-classification",
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(tiny_nli_dir),
        device="cpu",
        batch_size=16,
    )


def _assert_same(ours, theirs, labels, tol=1e-5):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert sorted(a.labels) == sorted(labels)
        mine, ref = dict(zip(a.labels, a.scores)), dict(zip(b["labels"], b["scores"]))
        np.testing.assert_allclose([mine[k] for k in labels], [ref[k] for k in labels], atol=tol, rtol=0)
        # best first, wherever the scores are not tied within the tolerance
        assert all(x >= y - tol for x, y in zip(a.scores, a.scores[1:]))
        assert abs(ref[a.labels[0]] - b["scores"][0]) <= tol


@pytest.mark.parametrize("multi_label", [False, True])
def test_nli_scores_equal_the_pipeline(nli, pipe, multi_label, monkeypatch):
    texts = _texts(28)
    # small blocks (a few texts each): pairs are built and scored block by block, order must survive
    monkeypatch.setattr(nli, "host", dataclasses.replace(nli.host, block_chars=len(LABELS) * 300))
    ours = nli.classify(texts, LABELS, multi_label=multi_label)
    theirs = pipe(texts, candidate_labels=LABELS, multi_label=multi_label)
    _assert_same(ours, theirs, LABELS)


def test_nli_single_label_and_template_match_the_pipeline(nli, pipe):
    texts = _texts(10, seed=1)
    template = "The topic of this text is {}"
    for labels in (["space"], ["cats", "dogs"]):
        ours = nli.classify(texts, labels, template=template)
        theirs = pipe(texts, candidate_labels=labels, hypothesis_template=template)
        _assert_same(ours, theirs, labels)
    # one label: scored on its own (entailment vs contradiction), as the pipeline does
    assert not all(r.scores[0] == pytest.approx(1.0) for r in nli.classify(texts, ["space"]))


def _manual_window_logits(model, tokenizer, text: str, hypothesis: str, max_length: int, stride: int):
    """Independent reference for --long chunk: every window's logits, built by hand from token ids."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    hyp = tokenizer(hypothesis, add_special_tokens=False)["input_ids"]
    room = max_length - 3 - len(hyp)  # [CLS] premise [SEP] hypothesis [SEP]
    starts = [0] if len(ids) <= room else [*range(0, len(ids) - room, room - stride), len(ids) - room]
    assert starts[-1] + room >= len(ids)
    rows = []
    for s in starts:
        premise = ids[s : s + room]
        input_ids = [tokenizer.cls_token_id, *premise, tokenizer.sep_token_id, *hyp, tokenizer.sep_token_id]
        types = [0] * (len(premise) + 2) + [1] * (len(hyp) + 1)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([input_ids]), token_type_ids=torch.tensor([types]))
        rows.append(out.logits[0].double().numpy())
    return np.stack(rows)


def test_chunked_nli_keeps_the_best_window_per_label(nli, tiny_nli_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_nli_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_nli_dir)
    texts = [_texts(7, seed=2)[i] for i in (0, 4, 5, 6)]  # ~1, 60, 150 and 300 words: 1 to 5 windows
    labels = LABELS[:3]
    stride = 16
    single = nli.classify(texts, labels, long="chunk", stride=stride)
    multi = nli.classify(texts, labels, long="chunk", stride=stride, multi_label=True)
    entail, contra = 2, 0
    for text, s_result, m_result in zip(texts, single, multi):
        windows = [
            _manual_window_logits(model, tokenizer, text, f"This example is {label}.", 128, stride) for label in labels
        ]
        best_entail = np.array([w[:, entail].max() for w in windows])
        expected_single = np.exp(best_entail - best_entail.max()) / np.exp(best_entail - best_entail.max()).sum()
        expected_multi = np.array([(1 / (1 + np.exp(w[:, contra] - w[:, entail]))).max() for w in windows])
        got_single = dict(zip(s_result.labels, s_result.scores))
        got_multi = dict(zip(m_result.labels, m_result.scores))
        np.testing.assert_allclose([got_single[k] for k in labels], expected_single, atol=1e-5)
        np.testing.assert_allclose([got_multi[k] for k in labels], expected_multi, atol=1e-5)


def test_auto_mode_picks_by_the_model_config(tiny_nli_dir, tiny_model_dir):
    assert Classifier(tiny_nli_dir, dtype="fp32").mode == "nli"
    assert Classifier(tiny_model_dir, dtype="fp32").mode == "embedding"


def _nli_copy(src: str, dst: Path, label2id: dict[str, int]) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["label2id"] = label2id
    config["id2label"] = {str(v): k for k, v in label2id.items()}
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
        ({"temperature": 0}, "temperature must be > 0"),
        ({"temperature": None}, "temperature must be a finite number, got None"),
        ({"threshold": float("nan")}, "threshold must be a finite number, got nan"),
        ({"threshold": None}, "threshold must be a finite number, got None"),
    ],
)
def test_a_temperature_or_threshold_that_gives_no_scores_is_refused_before_loading(option, message):
    """An infinite temperature scored every label alike, a NaN threshold made every multi-label score NaN, and None
    was a TypeError."""
    with pytest.raises(ConfigError, match=message):
        Classifier("not-loaded", **option)


def test_a_classify_output_is_not_read_as_embeddings(nli, tmp_path):
    nli.classify_to(["a cat", "a dog"], tmp_path / "out", ["cats", "dogs"])
    with pytest.raises(memfit.OutputError, match="a classify output; memfit.read reads embed outputs"):
        memfit.read(tmp_path / "out")


def test_errors_name_the_problem(tiny_nli_dir, tiny_model_dir, nli, tmp_path):
    with pytest.raises(ConfigError, match="no entailment class"):
        Classifier(tiny_model_dir, mode="nli")
    with pytest.raises(ConfigError, match="at least one label"):
        nli.classify(["a text"], [])
    with pytest.raises(ConfigError, match="duplicate labels"):
        nli.classify(["a text"], ["x", "y", "x"])
    with pytest.raises(ConfigError, match="no \\{\\} slot"):
        nli.classify(["a text"], ["x", "y"], template="no slot here")
    # a field other than the label itself (an attribute, an index, a conversion, a format spec), whatever the label
    for template in ("about {0.x}", "about {0[x]}", "about {0[3]}", "about {!r}", "about {:>9}", "about {0:{0}}"):
        with pytest.raises(ConfigError, match="a label slot is written {} or {0}") as refused:
            nli.classify(["a text"], ["sports", "art"], template=template)
        assert refused.value.field == "template"
    with pytest.raises(ConfigError, match="cannot be filled with the label 'sports'"):  # a second automatic slot
        nli.classify(["a text"], ["sports", "art"], template="about {} and {}")
    assert nli.classify(["a text"], ["sports", "art"], template="{{about}} {0}, {0}")[0].labels  # braces, twice
    for labels, template, field in (
        (["sp\ud800orts", "art"], "about {}", "labels"),
        (["a", "b"], "\udc00{}", "template"),
    ):
        with pytest.raises(ConfigError, match="lone surrogate") as refused:
            nli.classify(["a text"], labels, template=template)
        assert refused.value.field == field
    with pytest.raises(ConfigError, match="unknown classify mode"):
        Classifier(tiny_nli_dir, mode="zero-shot")
    # entailment but no contradiction among three classes: single-label works, multi-label cannot
    odd = Classifier(
        _nli_copy(tiny_nli_dir, tmp_path / "odd", {"other": 0, "neutral": 1, "Entailment": 2}), dtype="fp32"
    )
    assert odd.mode == "nli" and len(odd.classify(["a text"], ["x", "y"])[0].scores) == 2
    with pytest.raises(ConfigError, match="contradiction class"):
        odd.classify(["a text"], ["x", "y"], multi_label=True)


def test_cli_writes_parts_and_resumes(tiny_nli_dir, nli, tmp_path, capsys):
    texts = _texts(12, seed=3)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"doc": f"d{i}", "body": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "out"
    argv = [
        "classify",
        str(src),
        "--text-field",
        "body",
        "--id-field",
        "doc",
        "--labels",
        "cats, dogs,space,",
        "--multi-label",
        "--model",
        tiny_nli_dir,
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    ids, results = read_classifications(out)
    assert ids == [f"d{i}" for i in range(len(texts))]
    expected = nli.classify(texts, ["cats", "dogs", "space"], multi_label=True)
    for got, want in zip(results, expected):
        assert got.labels == want.labels
        np.testing.assert_allclose(got.scores, want.scores, atol=1e-6)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == len(texts)
    assert manifest["settings"]["mode"] == "nli" and manifest["counts"]["pairs"] == 3 * len(texts)
    # existing output: refused without --resume, a no-op with it, refused with other labels
    assert main(argv) == 2
    assert main(argv + ["--resume"]) == 0
    assert main([a if a != "cats, dogs,space," else "cats,dogs" for a in argv] + ["--resume"]) == 2
    assert "settings differ" in capsys.readouterr().err
    no_labels = [a if a != "cats, dogs,space," else " , " for a in argv[:-1]] + [str(tmp_path / "other")]
    assert main(no_labels) == 2
    assert "at least one label" in capsys.readouterr().err


def test_embedding_mode_matches_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = [
        "The rocket reached orbit and the crew docked with the station.",
        "Does god exist? Many atheists argue that faith needs no evidence.",
        "My cat sleeps on the keyboard all day.",
        "The film was a tedious, silly mess. " * 40,
    ]  # past MiniLM's 256-token window
    labels = ["space", "religion", "pets", "movies"]
    template = "This text is about {}."
    clf = Classifier(minilm_dir, dtype="fp32", device="cpu")
    assert clf.mode == "embedding"
    st = SentenceTransformer(minilm_dir, device="cpu")
    text_vectors = st.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    label_vectors = st.encode([template.format(x) for x in labels], normalize_embeddings=True, convert_to_numpy=True)
    cosine = text_vectors.astype(np.float64) @ label_vectors.T
    temperature, threshold = memfit.jobs.classify.DEFAULT_TEMPERATURE, memfit.jobs.classify.DEFAULT_SIMILARITY_THRESHOLD
    softmax = np.exp(cosine / temperature)
    softmax /= softmax.sum(axis=1, keepdims=True)
    sigmoid = 1 / (1 + np.exp(-(cosine - threshold) / temperature))
    for multi_label, expected in ((False, softmax), (True, sigmoid)):
        results = clf.classify(texts, labels, template=template, multi_label=multi_label)
        got = np.array([[dict(zip(r.labels, r.scores))[k] for k in labels] for r in results])
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert [r.labels[0] for r in clf.classify(texts, labels, template=template)] == [
        "space",
        "religion",
        "pets",
        "movies",
    ]


@pytest.fixture(scope="module")
def sentiment_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A random-weight 2-class sequence classifier with its own labels, like `memfit train` writes."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("tiny-sentiment")
    config = BertConfig.from_pretrained(
        tiny_model_dir, num_labels=2, id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1}
    )
    torch.manual_seed(2)
    BertForSequenceClassification(config).eval().save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(root)
    return with_graphs(str(root), openvino=("logits",))


def test_supervised_mode_equals_a_plain_forward_and_softmax(sentiment_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = _texts(12, seed=5)
    clf = Classifier(sentiment_dir, dtype="fp32", device="cpu")
    assert clf.mode == "supervised"
    results = clf.classify(texts)  # labels default to the model's own

    tok = AutoTokenizer.from_pretrained(sentiment_dir)
    model = AutoModelForSequenceClassification.from_pretrained(sentiment_dir).eval()
    for text, result in zip(texts, results):
        with torch.no_grad():
            logits = model(**tok(text, truncation=True, max_length=clf.max_length, return_tensors="pt")).logits[0]
        expected = dict(zip(["negative", "positive"], torch.softmax(logits, -1).tolist()))
        assert sorted(result.labels) == ["negative", "positive"]
        for label, score in zip(result.labels, result.scores):
            assert abs(score - expected[label]) < 1e-5
    # its scores are the trained softmax: multi_label or a template would be ignored (and recorded as applied)
    for option in ({"multi_label": True}, {"template": "It is about {}."}):
        with pytest.raises(ConfigError, match="apply to the zero-shot modes"):
            clf.classify(texts, **option)

    # the CLI picks supervised mode by itself and needs no --labels
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    assert main(["classify", str(src), "--model", sentiment_dir, "--dtype", "fp32", "-o", str(tmp_path / "o")]) == 0
    ids, written = read_classifications(tmp_path / "o")
    assert ids == list(range(len(texts)))
    assert [r.labels for r in written] == [r.labels for r in results]
    with pytest.raises(ConfigError, match="unknown"):
        clf.classify(texts, labels=["neutral"])


@pytest.fixture(scope="module")
def multi_label_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A random-weight 3-class classifier trained multi-label (``problem_type``), as transformers saves one."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("tiny-multi-label")
    labels = ["sports", "politics", "film"]
    config = BertConfig.from_pretrained(
        tiny_model_dir,
        num_labels=3,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        problem_type="multi_label_classification",
        initializer_range=0.5,
    )
    torch.manual_seed(4)
    BertForSequenceClassification(config).eval().save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(root)
    return str(root)


@pytest.mark.parametrize("model", ["one output", "multi-label"])
def test_supervised_scores_of_one_output_or_multi_label_models_equal_the_text_classification_pipeline(
    model, tiny_cross_encoder_dirs, multi_label_dir, tmp_path
):
    """The pipeline's default for these is each class's sigmoid: a softmax across the classes scored every text 1.0
    on a one-logit model (a cross-encoder's relevance), and made a multi-label model's classes compete."""
    from transformers import pipeline

    model_dir = tiny_cross_encoder_dirs["one_logit"] if model == "one output" else multi_label_dir
    backend = "auto" if model == "one output" else "torch"  # the first has its compiled graph already
    texts = _texts(10, seed=7)
    classify = pipeline("text-classification", model=model_dir, top_k=None, device="cpu")
    expected = [{row["label"]: row["score"] for row in rows} for rows in classify(texts, truncation=True)]
    assert np.ptp([max(scores.values()) for scores in expected]) > 0.01  # the texts score apart

    got = Classifier(model_dir, dtype="fp32", device="cpu", backend=backend).classify(texts)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(texts) + "\n")
    argv = ["classify", str(source), "--model", model_dir, "--dtype", "fp32", "--backend", backend]
    assert main([*argv, "-o", str(tmp_path / "out")]) == 0
    _, written = read_classifications(tmp_path / "out")
    for results in (got, written):
        for result, scores in zip(results, expected, strict=True):
            assert sorted(result.labels) == sorted(scores)
            for label, score in zip(result.labels, result.scores):
                assert abs(score - scores[label]) < 1e-5, (label, score, scores)
    # a run an earlier version began (softmax scores, no record of them) is not resumed into sigmoid ones
    manifest_path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["settings"]["scores"]
    manifest_path.write_text(json.dumps({**manifest, "complete": False}))
    assert main([*argv, "-o", str(tmp_path / "out"), "--resume"]) == 2


def test_zero_shot_modes_need_labels(nli):
    with pytest.raises(ConfigError, match="labels"):
        nli.classify(["a text"])


def test_embedding_mode_quality_guard_measures_the_texts_to_classify(
    tiny_model_dir, bf16_backend, monkeypatch, tmp_path
):
    """The precision guard sees the caller's texts (not the label prompts), in memory and streamed, and its
    refusal names no option that memfit classify lacks."""
    import memfit.jobs.encoder as encoder_module
    from memfit import QualityError

    measured: list[list[str]] = []
    real_windows = encoder_module.calibration_windows

    def recording_windows(tokenizer, special, max_length, texts):
        measured.append(list(texts))
        return real_windows(tokenizer, special, max_length, texts)

    monkeypatch.setattr(encoder_module, "calibration_windows", recording_windows)
    texts = [f"text number {i} about {topic}" for i, topic in enumerate(["cats", "stars", "tax"] * 30)]
    labels = ["animals", "space", "money"]
    Classifier(tiny_model_dir, dtype="bf16", backend=bf16_backend).classify(texts, labels)
    assert measured == [texts[:64]]  # the first 64 texts to classify, once
    measured.clear()
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n")
    manifest = Classifier(tiny_model_dir, dtype="bf16", backend=bf16_backend).classify_to(
        str(src), tmp_path / "out", labels
    )
    assert measured == [texts[:64]] and manifest["quality"]["texts"] == 64

    from memfit.engine import precision

    monkeypatch.setitem(precision.DEFAULT_MIN_COSINE, "bf16", 1.0 + 1e-9)  # a threshold no bf16 meets
    with pytest.raises(QualityError) as info:
        Classifier(tiny_model_dir, dtype="bf16", backend=bf16_backend).classify_to(
            str(src), tmp_path / "refused", labels
        )
    assert "--dtype fp32" in str(info.value) and "--min-cosine" not in str(info.value)
    assert not (tmp_path / "refused").exists()
