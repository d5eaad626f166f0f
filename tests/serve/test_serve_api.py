"""`memfit serve`'s rerank routes against sentence-transformers' CrossEncoder, and its OpenAPI document: every
route listed with request and response schemas, and real answers (errors included) valid against them.
``/docs`` in headless Chromium is in ``test_serve_docs_browser.py``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import pytest
from fastapi.routing import APIRoute

from memfit.serve import ServeOptions, create_app
from memfit.serve.routes import ROUTERS
from reference_outputs import DOCUMENTS, QUERIES, crossencoder_scores
from http_server import ThreadServer, post

ROUTES = {
    ("/health", "get"),
    ("/ready", "get"),
    ("/metrics", "get"),
    ("/info", "get"),
    ("/v1/models", "get"),
    ("/v1/embeddings", "post"),
    ("/embed", "post"),
    ("/embed_all", "post"),
    ("/tokenize", "post"),
    ("/classify", "post"),
    ("/rerank", "post"),
    ("/v1/rerank", "post"),
}
REQUEST_FIELDS = {  # what each request schema must offer: the fields of the shape the route follows
    "/v1/embeddings": {"input", "model", "encoding_format", "dimensions", "user"},
    "/embed": {"inputs", "normalize", "truncate"},
    "/embed_all": {"inputs", "truncate"},
    "/tokenize": {"inputs", "add_special_tokens"},
    "/classify": {"inputs", "labels", "multi_label", "template", "truncate"},
    "/rerank": {"query", "texts", "raw_scores", "return_text", "truncate"},
    "/v1/rerank": {"query", "documents", "top_n", "return_documents", "model"},
}


def server(model: str, **options) -> ThreadServer:
    return ThreadServer(create_app(ServeOptions(model=model, dtype="fp32", max_items=16, **options)))


@pytest.fixture(scope="module")
def embedding_server(tiny_model_dir):
    with server(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def nli_server(tiny_nli_dir):
    with server(tiny_nli_dir) as running:
        yield running


@pytest.fixture(scope="module")
def cross_encoder_servers(tiny_cross_encoder_dirs):
    with server(tiny_cross_encoder_dirs["one_logit"]) as one, server(tiny_cross_encoder_dirs["two_class"]) as two:
        yield {"one_logit": one, "two_class": two}


@pytest.mark.parametrize("backend", ["torch", "openvino"])
def test_info_names_the_backend_the_server_was_started_with(tiny_model_dir, backend):
    with server(tiny_model_dir, backend=backend) as running:
        info = httpx.get(running.url + "/info").json()
    assert info["backend"] == backend and info["model_dtype"] == "fp32"
    assert info["backend_choice"] == "asked for by name"


# -- rerank -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["one_logit", "two_class"])
def test_rerank_routes_answer_crossencoder_scores_best_first(cross_encoder_servers, tiny_cross_encoder_dirs, kind):
    url = cross_encoder_servers[kind].url
    query = QUERIES[0]
    want = crossencoder_scores(tiny_cross_encoder_dirs[kind], [(query, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])

    tei = post(url, "/rerank", {"query": query, "texts": DOCUMENTS, "return_text": True})
    assert tei.status_code == 200, tei.text
    hits = tei.json()
    assert [h["index"] for h in hits] == order
    np.testing.assert_allclose([h["score"] for h in hits], want[order], atol=1e-5, rtol=0)
    assert [h["text"] for h in hits] == [DOCUMENTS[i] for i in order]
    assert "text" not in post(url, "/rerank", {"query": query, "texts": DOCUMENTS}).json()[0]

    cohere = post(url, "/v1/rerank", {"query": query, "documents": DOCUMENTS, "top_n": 2, "return_documents": True})
    assert cohere.status_code == 200, cohere.text
    body = cohere.json()
    assert [r["index"] for r in body["results"]] == order[:2]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], want[order[:2]], atol=1e-5, rtol=0)
    assert [r["document"] for r in body["results"]] == [DOCUMENTS[i] for i in order[:2]]
    assert body["object"] == "rerank" and body["model"] == cross_encoder_servers[kind].runtime.served_name
    assert body["usage"]["prompt_tokens"] > len(DOCUMENTS) * 3
    everything = post(url, "/v1/rerank", {"query": query, "documents": DOCUMENTS}).json()["results"]
    assert len(everything) == len(DOCUMENTS) and "document" not in everything[0]


def test_raw_scores_are_the_logit(cross_encoder_servers, tiny_cross_encoder_dirs):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(tiny_cross_encoder_dirs["one_logit"], device="cpu")
    logits = model.predict([(QUERIES[1], d) for d in DOCUMENTS], activation_fn=lambda x: x)
    hits = post(
        cross_encoder_servers["one_logit"].url, "/rerank", {"query": QUERIES[1], "texts": DOCUMENTS, "raw_scores": True}
    ).json()
    np.testing.assert_allclose([h["score"] for h in sorted(hits, key=lambda h: h["index"])], logits, atol=1e-5)


def test_rerank_on_a_model_that_is_not_a_cross_encoder_is_400_with_the_reason(embedding_server):
    tei = post(embedding_server.url, "/rerank", {"query": "q", "texts": ["a"]})
    assert tei.status_code == 400 and "not a cross-encoder" in tei.json()["error"], tei.text
    cohere = post(embedding_server.url, "/v1/rerank", {"query": "q", "documents": ["a"]})
    assert cohere.status_code == 400 and "not a cross-encoder" in cohere.json()["error"]["message"], cohere.text
    assert post(embedding_server.url, "/embed", {"inputs": "still serving"}).status_code == 200


@pytest.mark.parametrize("path", ["/embed", "/v1/embeddings", "/classify", "/tokenize"])
def test_a_lone_surrogate_in_a_text_is_a_400_not_a_500(embedding_server, path):
    """JSON's "\\ud800" parses to a string that is not Unicode text; the tokenizer raised TypeError, a 500."""
    field = {"/embed": "inputs", "/v1/embeddings": "input", "/classify": "inputs", "/tokenize": "inputs"}[path]
    extra = ', "labels": ["a", "b"]' if path == "/classify" else ""
    body = f'{{"{field}": ["fine", "a\\ud800b"]{extra}}}'.encode()
    answer = httpx.post(
        embedding_server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert answer.status_code == 400, answer.text
    assert "lone surrogate" in answer.text
    assert post(embedding_server.url, "/embed", {"inputs": "still serving"}).status_code == 200


def post_escaped(url: str, path: str, body: dict) -> httpx.Response:
    """``body`` as JSON with every non-ASCII character escaped: a lone surrogate goes as ``"\\ud800"``, which
    parses to a string that is not Unicode text (httpx's own ``json=`` encodes to UTF-8, which refuses one)."""
    return httpx.post(
        url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}, timeout=60
    )


@pytest.mark.parametrize(
    "hosted, path, body, field",
    [
        ("nli", "/classify", {"inputs": ["fine"], "labels": ["a\ud800b", "c"]}, "labels"),
        ("nli", "/classify", {"inputs": ["fine"], "labels": ["a", "c"], "template": "about {}\udc00"}, "template"),
        ("embedding", "/classify", {"inputs": ["fine"], "labels": ["a\ud800b", "c"]}, "labels"),
        ("cross_encoder", "/rerank", {"query": "q\ud800", "texts": ["a"]}, "query"),
        ("cross_encoder", "/v1/rerank", {"query": "q\ud800", "documents": ["a"]}, "query"),
    ],
)
def test_a_lone_surrogate_in_a_label_template_or_query_is_a_422_naming_that_field(
    nli_server, embedding_server, cross_encoder_servers, hosted, path, body, field
):
    """Labels, templates and queries are tokenized apart from the texts: a surrogate there was a 500 (NLI) or a
    400 that blamed "a text"."""
    running = {"nli": nli_server, "embedding": embedding_server, "cross_encoder": cross_encoder_servers["one_logit"]}
    url = running[hosted].url
    answer = post_escaped(url, path, body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert f"field {field!r}" in message and "lone surrogate" in message, message
    if path.startswith("/v1/"):
        assert error["param"] == field
    fine = {**body, **{field: ["a", "c"] if field == "labels" else "about {}" if field == "template" else "q"}}
    assert post_escaped(url, path, fine).status_code == 200


@pytest.mark.parametrize(
    "template",
    [
        "{:>1000000000}",  # a width: a GB per label, built on the event loop
        "{0:{0}}",  # a width taken from the label itself (the label "999999999" below)
        "{!r:>99}",
        "{0.upper}",  # a field that is not the label: an attribute or an index of it
        "{0[0]}",
    ],
)
def test_a_template_field_other_than_a_plain_slot_is_a_422_naming_the_template(nli_server, embedding_server, template):
    for running in (nli_server, embedding_server):
        answer = post(running.url, "/classify", {"inputs": "x", "labels": ["999999999", "b"], "template": template})
        assert answer.status_code == 422, answer.text
        assert "field 'template'" in answer.json()["error"] and "{}" in answer.json()["error"], answer.text
        assert post(running.url, "/classify", {"inputs": "x", "labels": ["a", "b"]}).status_code == 200


def test_a_template_whose_labels_fill_more_than_a_body_is_a_422(nli_server, embedding_server):
    """Slots multiply a label: 200,000 slots of a 5,000-character label would be 10**9 characters per label from a
    body of 600 kB. The filled hypotheses may hold what a body may (--max-body-bytes), no more; the message quotes
    the template, not all of it."""
    for running in (nli_server, embedding_server):
        max_body = httpx.get(running.url + "/info").json()["max_body_bytes"]
        label = "word " * 1000
        slots = max_body // len(label) + 1  # filled: just over max_body characters, from a body of ~6 kB
        answer = post(running.url, "/classify", {"inputs": "x", "labels": [label, "b"], "template": "{0}" * slots})
        assert answer.status_code == 422, answer.text
        assert "field 'template'" in answer.json()["error"] and "--max-body-bytes" in answer.json()["error"]
        assert len(answer.json()["error"]) < 300
        assert post(running.url, "/classify", {"inputs": "x", "labels": ["a", "b"]}).status_code == 200


@pytest.mark.parametrize(
    "path, field", [("/v1/embeddings", "input"), ("/embed", "inputs"), ("/classify", "labels"), ("/rerank", "texts")]
)
def test_a_list_of_numbers_is_one_422_naming_its_first_item(embedding_server, cross_encoder_servers, path, field):
    """OpenAI's token-id input, or any list of non-strings: pydantic listed every bad item, and a body of a million
    numbers took 13 s on the event loop and 1.2 GiB before its 422. Now the first bad item is the one error."""
    running = cross_encoder_servers["one_logit"] if path == "/rerank" else embedding_server
    items = httpx.get(running.url + "/info").json()["max_body_bytes"] // 4  # "0, " each: within the body limit
    body = {"inputs": "x", "labels": ["a", "b"]} if path == "/classify" else {"query": "q"} if path == "/rerank" else {}
    answer = post(running.url, path, {**body, field: ["fine", *[0] * items]})
    assert answer.status_code == 422, answer.text[:500]
    error = answer.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert f"{field}[1]" in message and "not token ids" in message and len(message) < 300, message
    types = post(embedding_server.url, "/v1/embeddings", {"input": "x", "embedding_types": ["float", "int4"]})
    assert types.status_code == 422 and "embedding_types[1]" in types.json()["error"]["message"], types.text


@pytest.mark.parametrize(
    "path, body, field, wrong",
    [
        ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions", [True, "8", 8.0]),
        ("/embed", {"inputs": "x", "dimensions": 8}, "dimensions", [True, "8"]),
        ("/embed", {"inputs": "x", "normalize": False}, "normalize", ["false", 0]),
        ("/embed", {"inputs": "x", "truncate": False}, "truncate", [0, "no"]),
        ("/classify", {"inputs": "x", "labels": ["a", "b"], "multi_label": True}, "multi_label", ["yes", 1]),
    ],
)
def test_a_number_or_flag_of_another_json_type_is_a_422_naming_the_field(embedding_server, path, body, field, wrong):
    """``true`` is not 1 and ``"false"`` is not false: a lax parse read ``"dimensions": true`` as 1 and
    ``"normalize": "false"`` as false."""
    assert post(embedding_server.url, path, body).status_code == 200
    for value in wrong:
        answer = post(embedding_server.url, path, {**body, field: value})
        assert answer.status_code == 422, (value, answer.text)
        error = answer.json()["error"]
        assert f"field {field!r}" in (error["message"] if path.startswith("/v1/") else error), answer.text


@pytest.mark.parametrize("path", ["/embed", "/embed_all", "/rerank"])
def test_tei_truncation_direction_right_is_what_memfit_does_and_left_is_refused_where_it_truncates(
    embedding_server, cross_encoder_servers, path
):
    """huggingface_hub's InferenceClient sends TEI's ``truncation_direction``; dropped, a Left would have had the
    first tokens back. Without truncation it changes nothing, as in TEI."""
    url = (cross_encoder_servers["one_logit"] if path == "/rerank" else embedding_server).url
    text = " ".join(["word"] * 300)
    body = {"query": "q", "texts": [text]} if path == "/rerank" else {"inputs": text}
    plain = post(url, path, {**body, "truncate": True})
    assert plain.status_code == 200, plain.text
    for direction in ("Right", "right"):
        right = post(url, path, {**body, "truncate": True, "truncation_direction": direction})
        assert right.status_code == 200 and right.json() == plain.json()
    for direction in ("Left", "left"):
        left = post(url, path, {**body, "truncate": True, "truncation_direction": direction})
        assert left.status_code == 422 and "field 'truncation_direction'" in left.json()["error"], left.text
        whole = post(url, path, {**body, "truncate": False, "truncation_direction": direction})
        assert whole.json() == post(url, path, {**body, "truncate": False}).json()
    up = post(url, path, {**body, "truncation_direction": "Up"})
    assert up.status_code == 422 and "truncation_direction" in up.json()["error"], up.text


def test_a_supervised_classifier_refuses_a_template_as_a_template_it_does_not_use(cross_encoder_servers):
    """Its labels fill no template: the template-slot and filled-length checks of the zero-shot modes are not its."""
    url = cross_encoder_servers["two_class"].url
    labels = post(url, "/classify", {"inputs": "x"}).json()[0]["labels"]  # the model's own
    answer = post(url, "/classify", {"inputs": "x", "labels": labels, "template": "{:>9}"})
    assert answer.status_code == 400 and "zero-shot modes" in answer.json()["error"], answer.text


def test_a_label_the_cache_evicts_while_its_request_embeds_others_is_still_answered(embedding_server, monkeypatch):
    """A request's cached label texts could be evicted by its own new ones (or another request's) before it read
    them back: a KeyError, a 500."""
    import memfit.serve.host

    monkeypatch.setattr(memfit.serve.host, "LABEL_CACHE_SIZE", 2)
    url = embedding_server.url
    assert post(url, "/classify", {"inputs": "a match", "labels": ["sports", "cooking"]}).status_code == 200
    answer = post(url, "/classify", {"inputs": "a match", "labels": ["sports", "politics", "weather"]})
    assert answer.status_code == 200, answer.text
    monkeypatch.setattr(memfit.serve.host, "LABEL_CACHE_SIZE", 4096)
    embedding_server.runtime._labels.clear()
    fresh = post(url, "/classify", {"inputs": "a match", "labels": ["sports", "politics", "weather"]}).json()
    assert answer.json()[0]["labels"] == fresh[0]["labels"]
    np.testing.assert_allclose(answer.json()[0]["scores"], fresh[0]["scores"], atol=1e-6)


def test_long_label_texts_are_not_kept_in_the_label_cache(embedding_server):
    """The cache of label vectors lives outside the budget: a label text of a megabyte is embedded, not kept."""
    long_label = "sports " * 300  # 2,100 characters, filled into the template
    first = post(embedding_server.url, "/classify", {"inputs": "a match", "labels": [long_label, "cooking"]})
    again = post(embedding_server.url, "/classify", {"inputs": "a match", "labels": [long_label, "cooking"]})
    assert first.status_code == again.status_code == 200 and first.json()[0]["labels"] == again.json()[0]["labels"]
    np.testing.assert_allclose(first.json()[0]["scores"], again.json()[0]["scores"], atol=1e-6)
    kept = embedding_server.runtime._labels
    assert any(text.startswith("This example is cooking") for text in kept)  # short ones are cached
    assert all(len(text) <= 1024 for text in kept), [len(text) for text in kept]


@pytest.mark.parametrize(
    "path, body, status, field",
    [
        ("/rerank", {"query": "q", "texts": []}, 422, "texts"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": True}, 422, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": "1"}, 422, "top_n"),
        ("/rerank", {"query": "q", "texts": ["a"], "raw_scores": "true"}, 422, "raw_scores"),
        ("/rerank", {"texts": ["a"]}, 422, "query"),
        ("/rerank", {"query": "q", "texts": ["a"] * 17}, 413, "texts"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 422, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "model": "other"}, 404, "model"),
        ("/rerank", {"query": " ".join(["cat"] * 80), "texts": ["a"]}, 400, None),
        ("/rerank", {"query": " ".join(["cat"] * 60_000), "texts": ["a"]}, 400, "more than"),  # 240 kB, cut early
    ],
)
def test_bad_rerank_requests_name_their_field(cross_encoder_servers, path, body, status, field):
    answer = post(cross_encoder_servers["one_logit"].url, path, body)
    assert answer.status_code == status, answer.text
    message = answer.json()["error"]["message"] if path.startswith("/v1/") else answer.json()["error"]
    assert (field or "query") in message


# -- OpenAPI ----------------------------------------------------------------------------------------


def openapi(url: str) -> dict:
    answer = httpx.get(url + "/openapi.json", timeout=30)
    assert answer.status_code == 200
    return answer.json()


def response_schema(spec: dict, path: str, method: str, status: int) -> dict:
    content = spec["paths"][path][method]["responses"][str(status)]["content"]["application/json"]
    return {**content["schema"], "components": spec["components"]}  # $refs resolve against this root


def test_openapi_lists_every_route_with_request_and_response_schemas(embedding_server):
    spec = openapi(embedding_server.url)
    assert spec["openapi"].startswith("3.")
    listed = {(path, method) for path, methods in spec["paths"].items() for method in methods}
    assert listed == ROUTES
    served = {
        (r.path, m.lower())
        for router in ROUTERS
        for r in router.routes
        if isinstance(r, APIRoute) and r.include_in_schema
        for m in r.methods
    }
    assert served == ROUTES  # nothing the app's routers serve is missing from the document
    schemas = spec["components"]["schemas"]
    for path, method in ROUTES:
        operation = spec["paths"][path][method]
        assert operation.get("summary") and operation.get("tags"), (path, method)
        responses = operation["responses"]
        if method == "post":
            ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            request_schema = schemas[ref.rsplit("/", 1)[1]]
            assert REQUEST_FIELDS[path] <= set(request_schema["properties"]), path
            error = "OpenAIError" if path.startswith("/v1/") else "TeiError"
            for status in ("400", "413", "422", "429", "503"):
                assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith(error)
        if path in ("/health", "/ready"):
            assert set(responses) == {"200", "503"}
        elif path == "/metrics":
            assert "text/plain" in responses["200"]["content"]
        else:
            assert responses["200"]["content"]["application/json"]["schema"], path


def test_real_answers_and_errors_are_valid_against_the_document(embedding_server, cross_encoder_servers):
    """Each route's answer (and an error of each shape) validates against the schema the document gives it:
    the document describes what the server really sends."""
    checked = set()
    for running, calls in (
        (
            embedding_server,
            [
                ("get", "/info", None, 200),
                ("get", "/v1/models", None, 200),
                ("post", "/v1/embeddings", {"input": ["a cat", "a dog"]}, 200),
                ("post", "/v1/embeddings", {"input": "a cat", "encoding_format": "base64", "dimensions": 8}, 200),
                ("post", "/embed", {"inputs": ["a cat"]}, 200),
                ("post", "/embed_all", {"inputs": "a cat"}, 200),
                ("post", "/tokenize", {"inputs": ["a cat"]}, 200),
                ("post", "/classify", {"inputs": ["a cat"], "labels": ["cats", "dogs"]}, 200),
                ("post", "/rerank", {"query": "q", "texts": ["a"]}, 400),
                ("post", "/v1/rerank", {"query": "q", "documents": ["a"]}, 400),
                ("post", "/embed", {"inputs": [1]}, 422),
                ("post", "/v1/embeddings", {"input": "a", "model": "x"}, 404),
            ],
        ),
        (
            cross_encoder_servers["two_class"],
            [
                ("post", "/rerank", {"query": "q", "texts": ["a", "b"], "return_text": True}, 200),
                ("post", "/v1/rerank", {"query": "q", "documents": ["a", "b"], "return_documents": True}, 200),
                ("post", "/classify", {"inputs": ["a cat"]}, 200),
                ("post", "/embed", {"inputs": ["a cat"]}, 400),
            ],
        ),
    ):
        spec = openapi(running.url)
        for method, path, body, status in calls:
            answer = httpx.request(method, running.url + path, json=body, timeout=60)
            assert answer.status_code == status, (path, answer.text)
            jsonschema.validate(answer.json(), response_schema(spec, path, method, status))
            checked.add((path, method))
    assert checked == ROUTES - {("/health", "get"), ("/ready", "get"), ("/metrics", "get")}
