"""Prompts (a model's ``config_sentence_transformers.json`` ``prompts`` / ``default_prompt_name``, or one of the
caller's) against sentence-transformers' own ``encode(prompt_name=..., prompt=...)``, in Python, on the command
line and on ``memfit serve``'s routes; token rows and offsets against the tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import memfit
from conftest import PROMPTS
from memfit.errors import ConfigError, OutputError

TEXTS = [
    "the cat sat on the mat",
    "hello world, a good example",
    "",
    "   ",
    " ".join(["the long text of the world"] * 40),  # over one 128-token window with any prompt
]
LONG_TEXT = " ".join(f"word{i % 97} is a sentence about space and music" for i in range(60))  # ~600 tokens


@pytest.fixture(scope="module")
def encoders(tiny_prompt_dirs) -> dict[str, memfit.Encoder]:
    return {name: memfit.Encoder(path, dtype="fp32", backend="torch") for name, path in tiny_prompt_dirs.items()}


@pytest.fixture(scope="module")
def references(tiny_prompt_dirs):
    from sentence_transformers import SentenceTransformer

    return {name: SentenceTransformer(path, device="cpu") for name, path in tiny_prompt_dirs.items()}


@pytest.mark.parametrize("name", ["mean", "mean-excluded", "cls-excluded", "max-excluded"])
@pytest.mark.parametrize(
    "how", [{}, {"prompt_name": "passage"}, {"prompt_name": "instruct"}, {"prompt": ""}, {"prompt": "search: "}]
)
def test_pooled_vectors_equal_sentence_transformers_encode_with_prompts(encoders, references, name, how):
    """The default prompt applied when nothing is asked, a named one, none (``prompt=""``) and one of the caller's;
    ``include_prompt: false`` leaves the leading special tokens and the prompt out of mean, max and CLS pooling."""
    reference = references[name].encode(TEXTS, convert_to_numpy=True, **how)
    ours = encoders[name].embed(TEXTS, long="truncate", **how)  # sentence-transformers truncates long texts
    np.testing.assert_allclose(ours, reference, atol=1e-5)


@pytest.fixture(scope="module")
def graph_encoders(tiny_prompt_dirs) -> dict[str, memfit.Encoder]:
    """Two of the models on their compiled graphs, whose output the embedding head reduces in numpy (``pooling.py``):
    the prompt left out of a mean and of CLS (max reads the mean's mask; the prompt kept in is the plain path). Each
    is a conversion (~8 s), so two."""
    names = ("mean-excluded", "cls-excluded")
    return {name: memfit.Encoder(tiny_prompt_dirs[name], dtype="fp32", backend="openvino") for name in names}


@pytest.mark.parametrize("name", ["mean-excluded", "cls-excluded"])
@pytest.mark.parametrize("how", [{}, {"prompt": "search: "}])
def test_on_the_compiled_graph_too_pooled_vectors_equal_sentence_transformers_with_prompts(
    graph_encoders, references, name, how
):
    reference = references[name].encode(TEXTS, convert_to_numpy=True, **how)
    ours = graph_encoders[name].embed(TEXTS, long="truncate", **how)
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_the_default_prompt_changes_the_vectors(encoders, references):
    """A guard on the test above: the model's default prompt is really applied (no prompt gives other vectors)."""
    with_default = encoders["mean"].embed(TEXTS[:2])
    without = encoders["mean"].embed(TEXTS[:2], prompt="")
    assert np.abs(with_default - without).max() > 0.05
    np.testing.assert_allclose(without, references["mean"].encode(TEXTS[:2], prompt=""), atol=1e-5)


def _st_token_rows(reference, text: str, prompt: str) -> np.ndarray:
    """sentence-transformers' token vectors of ``prompt + text`` ([CLS] prompt text [SEP], truncated at 128)."""
    rows = reference.encode([text], prompt=prompt, output_value="token_embeddings", convert_to_numpy=True)[0]
    return np.asarray(rows)


@pytest.mark.parametrize("backend, name", [("torch", "mean"), ("openvino", "mean-excluded")])
def test_token_rows_leave_the_prompt_out_and_keep_the_texts_offsets(
    encoders, graph_encoders, references, tiny_prompt_dirs, backend, name
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_prompt_dirs[name])
    texts = ["the cat sat on the mat", "hello world, a good example", ""]
    ours = (encoders if backend == "torch" else graph_encoders)[name].embed_tokens(texts, prompt_name="passage")
    prompt_tokens = len(tokenizer(PROMPTS["passage"], add_special_tokens=False)["input_ids"])
    for text, got in zip(texts, ours):
        expected = tokenizer(text, return_offsets_mapping=True)
        assert got.token_ids.tolist() == expected["input_ids"]
        assert got.offsets.tolist() == [list(o) for o in expected["offset_mapping"]]
        assert all(text[s:e] for s, e in got.offsets[1:-1])
        st_rows = _st_token_rows(references[name], text, PROMPTS["passage"])
        without_prompt = np.delete(st_rows, np.s_[1 : 1 + prompt_tokens], axis=0)  # the model read the prompt
        np.testing.assert_allclose(got.embeddings, without_prompt, atol=1e-5)


def test_every_window_of_a_chunked_long_text_carries_the_prompt(encoders, references, tiny_prompt_dirs):
    """A chunked long text's first tokens get the vectors of ``prompt + text`` truncated to the window (the first
    window), and its last tokens those of ``prompt + the text's tail`` (the last window): both read the prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_prompt_dirs["mean"])
    prompt = PROMPTS["query"]  # the default
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    encoded = tokenizer(LONG_TEXT, add_special_tokens=False, return_offsets_mapping=True)
    content = 128 - 2 - n_prompt  # what a window leaves for text beside [CLS], [SEP] and the prompt
    assert len(encoded["input_ids"]) > 3 * content

    got = encoders["mean"].embed_tokens([LONG_TEXT], long="chunk")[0]
    assert got.token_ids.tolist() == tokenizer(LONG_TEXT)["input_ids"]  # every token once, no prompt rows
    head = _st_token_rows(references["mean"], LONG_TEXT, prompt)
    head = np.delete(head, np.s_[1 : 1 + n_prompt], axis=0)  # [CLS] + the first `content` tokens + [SEP]
    np.testing.assert_allclose(got.embeddings[:20], head[:20], atol=1e-5)

    tail_start = encoded["offset_mapping"][len(encoded["input_ids"]) - content][0]
    tail = _st_token_rows(references["mean"], LONG_TEXT[tail_start:], prompt)
    np.testing.assert_allclose(got.embeddings[-20:], tail[-20:], atol=1e-5)


def test_prompt_too_long_for_the_window_is_refused(encoders):
    with pytest.raises(ConfigError, match="prompt takes .* tokens and leaves no room"):
        encoders["mean"].embed(["a text"], prompt="the " * 130)


def test_unknown_prompt_name_and_both_forms_are_refused_naming_the_option(encoders):
    with pytest.raises(ConfigError, match=r"unknown --prompt-name 'nope'; this model's prompts: 'query', 'passage'"):
        encoders["mean"].embed(["a text"], prompt_name="nope")
    with pytest.raises(ConfigError, match="--prompt or --prompt-name, not both"):
        encoders["mean"].embed(["a text"], prompt_name="query", prompt="x: ")


def test_embed_to_records_the_prompt_in_the_manifest_and_resume_keeps_it(encoders, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS[:2]) + "\n")
    manifest = encoders["mean-excluded"].embed_to(source, tmp_path / "out", prompt_name="passage")
    assert manifest["settings"]["prompt"] == {
        "name": "passage",
        "text": PROMPTS["passage"],
        "include_in_pooling": False,
    }
    with pytest.raises(OutputError, match="settings differ.*prompt"):
        encoders["mean-excluded"].embed_to(source, tmp_path / "out", prompt_name="query", resume=True)
    default = encoders["mean"].embed_to(TEXTS, tmp_path / "default")
    assert default["settings"]["prompt"]["name"] == "query"
    assert encoders["mean"].embed_to(TEXTS, tmp_path / "none", prompt="")["settings"]["prompt"] is None


def _memfit(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, timeout=300)


def test_cli_prompt_name_and_prompt_equal_sentence_transformers(tiny_prompt_dirs, references, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(TEXTS[:2] + ["a short one"]) + "\n")
    texts = source.read_text().splitlines()
    for flags, how in (
        ([], {}),
        (["--prompt-name", "passage"], {"prompt_name": "passage"}),
        (["--prompt", "search: "], {"prompt": "search: "}),
    ):
        out = tmp_path / f"out{len(flags)}{how.get('prompt', '')}"
        done = _memfit(
            "embed", str(source), "--model", tiny_prompt_dirs["mean"], "--dtype", "fp32", "-o", str(out), *flags
        )
        assert done.returncode == 0, done.stderr
        reference = references["mean"].encode(texts, convert_to_numpy=True, **how)
        np.testing.assert_allclose(memfit.read(out).embeddings, reference, atol=1e-5)
        assert "put before every text" in done.stderr


def test_cli_refuses_bad_prompt_options_in_one_line(tiny_prompt_dirs, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("a text\n")
    model = ["--model", tiny_prompt_dirs["mean"], "--backend", "torch"]
    for flags, message in (
        (["--prompt-name", "nope"], "unknown --prompt-name 'nope'"),
        (["--prompt-name", "query", "--prompt", "x"], "give --prompt or --prompt-name, not both"),
    ):
        done = _memfit("embed", str(source), *model, "-o", str(tmp_path / "out"), *flags)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], done.stderr
        assert "Traceback" not in done.stderr
        assert not (tmp_path / "out" / "manifest.json").exists()


def test_serve_routes_take_prompt_name_as_tei_does(tiny_prompt_dirs, references):
    import httpx
    from http_server import ThreadServer, post

    from memfit.serve import ServeOptions, create_app

    texts = TEXTS[:2]
    reference = references["mean"]
    with ThreadServer(create_app(ServeOptions(model=tiny_prompt_dirs["mean"], dtype="fp32"))) as server:
        tei = post(server.url, "/embed", {"inputs": texts, "prompt_name": "passage"})
        np.testing.assert_allclose(
            np.array(tei.json()), reference.encode(texts, prompt_name="passage", normalize_embeddings=True), atol=1e-5
        )
        default = post(server.url, "/embed", {"inputs": texts})  # the model's default prompt, as TEI applies it
        np.testing.assert_allclose(
            np.array(default.json()), reference.encode(texts, normalize_embeddings=True), atol=1e-5
        )
        openai = post(server.url, "/v1/embeddings", {"input": texts, "prompt_name": "passage"}).json()
        np.testing.assert_allclose(
            np.array([d["embedding"] for d in openai["data"]]),
            reference.encode(texts, prompt_name="passage", normalize_embeddings=True),
            atol=1e-5,
        )
        rows = post(server.url, "/embed_all", {"inputs": texts[:1], "prompt_name": "passage"}).json()[0]
        assert len(rows) == len(reference.tokenizer(texts[0])["input_ids"])  # no rows for the prompt
        # TEI's /tokenize puts the prompt before the text as its embedding routes do, offsets in the prompted text
        for body, prompt in (({}, PROMPTS["query"]), ({"prompt_name": "passage"}, PROMPTS["passage"])):
            tokens = post(server.url, "/tokenize", {"inputs": texts, **body}).json()
            for text, got in zip(texts, tokens, strict=True):
                expected = reference.tokenizer(prompt + text, return_offsets_mapping=True)
                assert [token["id"] for token in got] == expected["input_ids"]
                spans = [(t["start"], t["stop"]) for t in got if not t["special"]]
                assert spans == [tuple(span) for span in expected["offset_mapping"][1:-1]]
                assert "".join(t["text"] for t in got if not t["special"]).replace(" ", "") == (
                    (prompt + text).replace(" ", "")
                )
        bad_paths = (("/embed", {"inputs": "x"}), ("/v1/embeddings", {"input": "x"}), ("/tokenize", {"inputs": "x"}))
        for path, body in bad_paths:
            bad = post(server.url, path, {**body, "prompt_name": "nope"})
            assert bad.status_code == 422, bad.text
            error = bad.json()["error"]
            message = error["message"] if path.startswith("/v1/") else error
            assert "field 'prompt_name'" in message and "'query'" in message
            if path.startswith("/v1/"):
                assert error["param"] == "prompt_name"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_model_without_prompts_gets_none(tiny_model_dir, tmp_path):
    """No ``config_sentence_transformers.json``: nothing is put before the texts, and naming a prompt is refused."""
    encoder = memfit.Encoder(tiny_model_dir, dtype="fp32", backend="torch")
    np.testing.assert_allclose(encoder.embed(TEXTS[:2]), encoder.embed(TEXTS[:2], prompt=""), atol=0)
    with pytest.raises(ConfigError, match="this model's prompts: none"):
        encoder.embed(["x"], prompt_name="query")
    manifest = encoder.embed_to(TEXTS[:2], tmp_path / "out")
    assert manifest["settings"]["prompt"] is None
    assert json.loads((Path(tmp_path) / "out" / "manifest.json").read_text())["settings"]["prompt"] is None
