"""Input from and output to S3-compatible object storage (issue #28), against a real S3 server on loopback.

The server is moto's standalone server (``moto[server]``; MinIO's server is not packaged on PyPI,
Debian or npm), started by a fixture on 127.0.0.1 with authentication on: an IAM user with an access
key is created first, and from then on every request must be signed with that key, so wrong
credentials are refused as a real store refuses them. memfit gets the endpoint and credentials only
from the AWS SDK's standard environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``AWS_REGION``), as a user's command would. The reference for every output is the
same corpus embedded from one local JSONL file.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")


import memfit  # noqa: E402
from memfit.errors import OutputError  # noqa: E402
from reference_outputs import row_cosines  # noqa: E402

WORDS = "north wind carries salt over the harbour where boats wait for a calm grey morning".split()
BUDGET = "4GiB"
PART = 25


def _rows(n: int) -> list[dict]:
    rows = [
        {"doc": f"d{i}", "body": " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + (i * 31) % 60))}
        for i in range(n)
    ]
    rows[3]["body"] = ""
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with authentication; the environment points memfit at it.

    ``INITIAL_NO_AUTH_ACTION_COUNT=3`` lets the three IAM calls that create the user, its policy and
    its key through unsigned; every later request needs that key."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="memfit")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="memfit", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="memfit")["AccessKey"]
        env = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": "us-east-1",
        }
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket="corpus")
        client.create_bucket(Bucket="out")
        yield client
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def _keys(client, bucket: str, prefix: str) -> list[str]:
    """The objects under ``prefix``, less zero-byte directory markers (``prefix/``): pyarrow's S3 filesystem
    puts one back when a delete empties what it takes for a directory, and every reader, memfit's and
    pyarrow's, passes over it (docs/inputs.md)."""
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(
        item["Key"] for item in listed.get("Contents", []) if not (item["Key"].endswith("/") and item["Size"] == 0)
    )


def _put_shards(client, rows: list[dict], prefix: str, splits: int = 3) -> None:
    size = -(-len(rows) // splits)
    for index in range(splits):
        data = "".join(json.dumps(r) + "\n" for r in rows[index * size : (index + 1) * size]).encode()
        client.put_object(Bucket="corpus", Key=f"{prefix}/part-{index:05d}.jsonl.gz", Body=gzip.compress(data))


def _args(source: str, out: str, model: str) -> list[str]:
    return [
        "embed",
        source,
        "-o",
        out,
        "--model",
        model,
        "--dtype",
        "fp32",
        "--memory-budget",
        BUDGET,
        "--text-field",
        "body",
        "--id-field",
        "doc",
        "--part-size",
        str(PART),
    ]


def _memfit(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memfit", *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


@pytest.fixture(scope="module")
def local_reference(tiny_model_dir, tmp_path_factory):
    """The corpus in one local JSONL file, embedded locally, and that file."""
    folder = tmp_path_factory.mktemp("s3-reference")
    rows = _rows(230)
    (folder / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _memfit(_args(str(folder / "all.jsonl"), str(folder / "out"), tiny_model_dir))
    assert result.returncode == 0, result.stderr
    return rows, memfit.read(folder / "out")


def _assert_same(got: memfit.EmbeddingOutput, reference: memfit.EmbeddingOutput) -> None:
    assert got.ids == reference.ids
    assert len(set(got.ids)) == len(got.ids)  # every id exactly once
    np.testing.assert_array_equal(got.embeddings, reference.embeddings)


def test_embed_from_s3_shards_to_s3_equals_the_local_jsonl(s3, local_reference, tiny_model_dir):
    rows, reference = local_reference
    _put_shards(s3, rows, "gz")
    result = _memfit(_args("s3://corpus/gz/part-*.jsonl.gz", "s3://out/gz", tiny_model_dir))
    assert result.returncode == 0, result.stderr
    got = memfit.read("s3://out/gz")
    _assert_same(got, reference)
    assert got.manifest["settings"]["input"] == "s3://corpus/gz/part-*.jsonl.gz"
    assert set(got.manifest["input_fingerprint"]["files"]) == {f"part-{i:05d}.jsonl.gz" for i in range(3)}
    assert _keys(s3, "out", "gz/") == ["gz/manifest.json"] + [f"gz/part-{i:05d}.parquet" for i in range(10)]


def test_ray_from_the_bucket_to_the_bucket_equals_the_local_jsonl_and_resumes_a_damaged_part(
    s3, local_reference, tiny_model_dir
):
    """``--executor ray`` from Parquet shards by URL to a prefix in the bucket. Ray's read tasks open the
    objects themselves (in worker processes, with the same credentials from the environment), one row group
    per task, rows numbered across the shards from their footers; the workers upload their parts and the
    driver PUTs the manifest. A part truncated in the bucket is found by ``--resume`` on Ray and computed
    again."""
    pytest.importorskip("ray")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, reference = local_reference
    for index, start in enumerate(range(0, len(rows), 80)):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows[start : start + 80]), sink, row_group_size=30)
        s3.put_object(Bucket="corpus", Key=f"pq/part-{index:05d}.parquet", Body=sink.getvalue().to_pybytes())
    args = _args("s3://corpus/pq/", "s3://out/ray", tiny_model_dir) + ["--executor", "ray", "--workers", "2"]
    result = _memfit(args)
    assert result.returncode == 0, result.stderr

    def assert_equal_to_the_reference() -> memfit.EmbeddingOutput:
        got = memfit.read("s3://out/ray")
        assert got.manifest["complete"] and got.manifest["settings"]["input"] == "s3://corpus/pq/"
        assert got.ids == reference.ids and len(set(got.ids)) == len(got.ids)
        assert row_cosines(got.embeddings, reference.embeddings).min() >= 0.99999
        return got

    parts = [entry["file"] for entry in assert_equal_to_the_reference().manifest["parts"]]
    assert _keys(s3, "out", "ray/") == ["ray/manifest.json"] + [f"ray/{name}" for name in sorted(parts)]

    damaged = f"ray/{parts[1]}"
    body = s3.get_object(Bucket="out", Key=damaged)["Body"].read()
    s3.put_object(Bucket="out", Key=damaged, Body=body[:-100])
    resumed = _memfit([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(rf"s3://out/{damaged}: \d+ bytes on disk, \d+ when it was written", resumed.stderr), resumed.stderr
    assert_equal_to_the_reference()
    assert s3.head_object(Bucket="out", Key=damaged)["ContentLength"] == len(body)


def test_a_ray_worker_uploads_token_rows_renumbered_to_the_input(s3, tmp_path):
    """The token table a Ray worker writes into the bucket (streamed row group by row group, no rename): its
    rows are the scratch run's shifted to the input's row numbers, every vector as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from memfit.io.storage import OutputLocation
    from memfit.ray.worker import renumbered_tokens

    for index in range(2):
        table = pa.table({"row": pa.array([0, 0, 1, 2][index:], pa.int64()), "value": [1.5, 2.5, 3.5, 4.5][index:]})
        pq.write_table(table, tmp_path / f"scratch-{index}.parquet", row_group_size=2)
    entry = renumbered_tokens(
        [tmp_path / "scratch-0.parquet", tmp_path / "scratch-1.parquet"],
        100,
        OutputLocation("s3://out/tokens"),
    )
    body = s3.get_object(Bucket="out", Key="tokens/tokens-00100.parquet")["Body"].read()
    assert entry == {"file": "tokens-00100.parquet", "rows": 7, "bytes": len(body)}
    written = pq.read_table(pa.BufferReader(body))
    assert written.column("row").to_pylist() == [100, 100, 101, 102, 100, 101, 102]
    assert written.column("value").to_pylist() == [1.5, 2.5, 3.5, 4.5, 2.5, 3.5, 4.5]


def _kill_after_first_listed_part(s3, args: list[str], bucket: str, manifest_key: str) -> dict:
    """Run memfit, kill -9 it once the manifest in the bucket lists a part; return that manifest.

    The manifest is read with one GET, which S3 answers with one whole version of the object. pyarrow's input
    stream asks for the size first and then for that many bytes, so a manifest replaced by a longer one in
    between came back cut at the old length (seen once in CI: invalid JSON at char 1,155)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "memfit", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 240
    manifest: dict = {}
    while time.time() < deadline and proc.poll() is None:
        try:
            manifest = json.loads(s3.get_object(Bucket=bucket, Key=manifest_key)["Body"].read())
        except s3.exceptions.NoSuchKey:
            manifest = {}
        if manifest.get("parts"):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert manifest.get("parts") and not manifest["complete"], "the run was not caught between parts"
    return manifest


def test_kill_9_then_resume_in_the_bucket_equals_an_uninterrupted_run(s3, tiny_model_dir, tmp_path):
    rows = _rows(230) * 6  # enough parts that the kill lands mid-run
    rows = [{**r, "doc": f"d{i}"} for i, r in enumerate(rows)]
    s3.put_object(Bucket="corpus", Key="big/all.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows).encode())
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = _args("s3://corpus/big/all.jsonl", "s3://out/killed", tiny_model_dir)
    killed_at = _kill_after_first_listed_part(s3, args, "out", "killed/manifest.json")

    resumed = _memfit([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    straight = _memfit(_args(str(tmp_path / "all.jsonl"), str(tmp_path / "straight"), tiny_model_dir))
    assert straight.returncode == 0, straight.stderr
    got = memfit.read("s3://out/killed")
    assert got.manifest["parts"][: len(killed_at["parts"])] == killed_at["parts"]  # kept, not recomputed
    _assert_same(got, memfit.read(tmp_path / "straight"))
    names = _keys(s3, "out", "killed/")
    assert names == ["killed/manifest.json"] + [f"killed/part-{i:05d}.parquet" for i in range(len(rows) // PART + 1)]


def test_a_damaged_part_in_the_bucket_is_found_and_recomputed(s3, local_reference, tiny_model_dir):
    rows, reference = local_reference
    s3.put_object(Bucket="corpus", Key="one/all.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows).encode())
    args = _args("s3://corpus/one/all.jsonl", "s3://out/damaged", tiny_model_dir)
    assert _memfit(args).returncode == 0
    body = s3.get_object(Bucket="out", Key="damaged/part-00002.parquet")["Body"].read()
    s3.put_object(Bucket="out", Key="damaged/part-00002.parquet", Body=body[:-100])  # truncated

    resumed = _memfit([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(
        r"memfit: s3://out/damaged/part-00002\.parquet: \d+ bytes on disk, \d+ when it was written", resumed.stderr
    ), resumed.stderr
    assert "recomputing from row 50 (2 of 10 parts kept)" in resumed.stderr
    got = memfit.read("s3://out/damaged")
    assert got.manifest["complete"]
    _assert_same(got, reference)


def test_a_missing_bucket_is_one_line_exit_2_and_nothing_written(s3, tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"doc": "a", "body": "text"}) + "\n")
    buckets = [b["Name"] for b in s3.list_buckets()["Buckets"]]
    result = _memfit(_args(str(src), "s3://no-such-bucket/run", tiny_model_dir))
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "s3://no-such-bucket/run: bucket 'no-such-bucket' does not exist" in err
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == buckets


@pytest.mark.parametrize("where", ["output", "input"])
def test_wrong_credentials_are_one_line_exit_2_and_nothing_written(
    s3, local_reference, tiny_model_dir, tmp_path, where
):
    rows, _ = local_reference
    s3.put_object(Bucket="corpus", Key="creds/all.jsonl", Body=json.dumps(rows[0]).encode() + b"\n")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(rows[0]) + "\n")
    source, out = (
        (str(src), "s3://out/creds") if where == "output" else ("s3://corpus/creds/all.jsonl", str(tmp_path / "out"))
    )
    result = _memfit(_args(source, out, tiny_model_dir), AWS_SECRET_ACCESS_KEY="not-the-secret")
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "SIGNATURE_DOES_NOT_MATCH" in err or "ACCESS_DENIED" in err, err
    assert _keys(s3, "out", "creds/") == []
    assert not Path(tmp_path / "out").exists()


def test_a_part_whose_upload_fails_leaves_no_object_under_its_name(s3, monkeypatch):
    """pyarrow's S3 stream completes its upload when it is closed or garbage-collected, so a write that fails
    half-way would publish the half under the part's name; the writer drops it instead."""
    import gc

    import pyarrow as pa

    from memfit.io import sinks

    def fails_half_way(table, target, **options):
        target.write(b"PAR1 the first half of a part")
        raise OSError("the network went away")

    monkeypatch.setattr(sinks.pq, "write_table", fails_half_way)
    writer = sinks.PartWriter("s3://out/abandoned", {"job": "embed"})
    with pytest.raises(OutputError, match=r"abandoned/part-00000\.parquet: cannot write: the network went away$"):
        writer.write_part(pa.table({"id": [0], "embedding": [[0.5, 0.25]]}))  # one line, not a traceback
    gc.collect()  # what a stream still open would upload now
    assert _keys(s3, "out", "abandoned/") == []
