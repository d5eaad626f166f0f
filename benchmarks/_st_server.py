"""The plain baseline of bench_serve.py: FastAPI + sentence-transformers ``encode``, as a tutorial writes it.

POST /v1/embeddings (OpenAI shape) runs ``model.encode`` on the request's texts in FastAPI's thread
pool; no batching across requests, no memory limit, texts truncated at the model's ``max_seq_length``.

    python benchmarks/_st_server.py --model DIR --port 8000
"""

from __future__ import annotations

import argparse

import uvicorn
from _measure import sentence_transformer, st_encode
from fastapi import FastAPI
from pydantic import BaseModel


class EmbeddingsRequest(BaseModel):
    input: str | list[str]
    model: str | None = None
    encoding_format: str = "float"


def build(model_dir: str) -> FastAPI:
    model = sentence_transformer(model_dir)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/v1/embeddings")
    def embeddings(body: EmbeddingsRequest) -> dict:
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = st_encode(model, texts)
        return {
            "object": "list",
            "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)],
        }

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(build(args.model), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
