"""The store (app/core/storage.py) against the data directory and against a real S3 protocol server (moto's),
and uploads kept in a bucket as two hosts see them."""
import io
import os
from pathlib import Path

import pytest

from tests.helpers.jobs import tiny_job
from tests.helpers.runner import run_in_process
from tests.helpers.service import free_port
from trainyard.app import uploads
from trainyard.app.core import storage
from trainyard.app.core.errors import Invalid, NotFound, Unavailable
from trainyard.app.core.layout import Layout
from trainyard.app.core.settings import Settings

IRIS_CSV = b"a,b,species\n" + b"".join(f"{i % 7}.0,{i % 5}.5,{'xyz'[i % 3]}\n".encode() for i in range(60))


@pytest.fixture(params=["data-dir", "s3"])
def store(request, tmp_path):
    layout = Layout(tmp_path / "host-a")
    if request.param == "data-dir":
        return storage.Store(layout)
    bucket = request.getfixturevalue("bucket")
    return storage.S3Store(layout, bucket.name, "pre/fix")


def write(store: storage.Store, key: str, data: bytes):
    path = store.layout.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_publish_fetch_stream_list_delete(store):
    big = os.urandom(9 << 20)  # over boto3's multipart threshold (8 MiB): sent in parts
    store.publish(write(store, "artifacts/1/run-1/model.safetensors", big))
    store.publish(write(store, "artifacts/1/run-1/meta.json", b"{}"))
    store.publish(write(store, "checkpoints/1/run-1-e00001-s000000.pt", b"ck"))

    assert store.keys("artifacts/1") == ["artifacts/1/run-1/meta.json", "artifacts/1/run-1/model.safetensors"]
    assert store.size("artifacts/1/run-1/model.safetensors") == len(big)
    chunks = list(store.stream("artifacts/1/run-1/model.safetensors"))
    assert b"".join(chunks) == big and max(map(len, chunks)) <= storage.CHUNK
    assert store.read_bytes("artifacts/1/run-1/meta.json") == b"{}"
    with pytest.raises(FileNotFoundError):
        store.stream("artifacts/1/run-1/model.pt")
    with pytest.raises(FileNotFoundError):
        store.fetch("artifacts/2/run-1/meta.json")
    with pytest.raises(Invalid):
        store.fetch("../outside")

    store.delete("checkpoints/1/run-1-e00001-s000000.pt")
    assert store.keys("checkpoints/1") == []
    store.delete_prefix("artifacts/1")
    assert store.keys("artifacts") == []
    assert not (store.layout.root / "artifacts/1/run-1/meta.json").exists()


def test_another_host_fetches_what_one_published(bucket, tmp_path):
    a = storage.S3Store(Layout(tmp_path / "a"), bucket.name, "p")
    b = storage.S3Store(Layout(tmp_path / "b"), bucket.name, "p")
    a.publish(write(a, "logs/3.log", b"run 1\n"))
    assert b.fetch("logs/3.log").read_bytes() == b"run 1\n"
    a.publish(write(a, "logs/3.log", b"run 1\nrun 2\n"))
    assert b.fetch("logs/3.log").read_bytes() == b"run 1\n"  # a cached copy, unless asked to refresh
    assert b.fetch("logs/3.log", refresh=True).read_bytes() == b"run 1\nrun 2\n"
    assert [k for k in bucket.keys()] == ["p/logs/3.log"]  # under the prefix, nothing beside it
    assert not list((tmp_path / "b").rglob("*.part"))


def test_uploads_in_a_bucket_are_seen_and_deleted_by_every_host(bucket, tmp_path):
    a = storage.S3Store(Layout(tmp_path / "a"), bucket.name, "")
    b = storage.S3Store(Layout(tmp_path / "b"), bucket.name, "")
    meta = uploads.store(io.BytesIO(IRIS_CSV), "iris.csv", a, "species")
    assert f"datasets/uploads/{meta['id']}/meta.json" in bucket.keys()
    assert [m["id"] for m in uploads.list_all(b)] == [meta["id"]]
    assert uploads.get(b, meta["id"])["samples"] == 60
    uploads.delete(b, meta["id"])
    assert uploads.list_all(a) == [] and bucket.keys() == []
    with pytest.raises(NotFound):
        uploads.get(a, meta["id"])


def test_upload_quota_counts_the_bucket(bucket, tmp_path):
    a = storage.S3Store(Layout(tmp_path / "a"), bucket.name, "")
    b = storage.S3Store(Layout(tmp_path / "b"), bucket.name, "")
    uploads.store(io.BytesIO(IRIS_CSV), "one.csv", a, "species")
    with pytest.raises(Exception) as refused:
        uploads.store(io.BytesIO(IRIS_CSV), "two.csv", b, "species", uploads.Limits(max_uploads=1))
    assert "at most 1" in str(refused.value)
    assert len(uploads.list_all(b)) == 1


def test_storage_url_is_checked_at_startup(monkeypatch):
    monkeypatch.setenv("TRAINYARD_STORAGE_URL", "gs://bucket")
    with pytest.raises(ValueError, match="expected s3://bucket/prefix"):
        Settings()
    assert storage.parse_url("s3://b/some/prefix/") == ("b", "some/prefix")
    with pytest.raises(ValueError, match="names no bucket"):
        storage.parse_url("s3:///prefix")


def test_a_job_process_publishes_its_checkpoints_and_model_to_the_bucket(bucket, tmp_path):
    final, events = run_in_process(tmp_path, tiny_job(epochs=2, checkpoint_every_s=0), storage_url=bucket.url)
    assert final["type"] == "done"
    checkpoints = [e["path"] for e in events if e["type"] == "checkpoint"]
    keys = bucket.keys()
    # Each checkpoint is in the bucket before the supervisor hears of it (it records only those).
    assert checkpoints and all(f"trainyard/{Layout(tmp_path).rel(p)}" in keys for p in checkpoints)
    assert {"trainyard/art/model.safetensors", "trainyard/art/model.pt", "trainyard/art/meta.json"} <= set(keys)


@pytest.mark.slow  # the client's retries back off for about ten seconds before it gives up
def test_an_unreachable_store_fails_the_run_as_infrastructure(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # nothing listens
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    store = storage.S3Store(Layout(tmp_path / "a"), "nowhere")
    with pytest.raises(Unavailable):
        store.publish(write(store, "logs/1.log", b"x"))
    with pytest.raises(Unavailable):
        store.fetch("logs/2.log")
    (tmp_path / "job").mkdir()
    final, _ = run_in_process(tmp_path / "job", tiny_job(epochs=1), storage_url="s3://nowhere/p")
    assert final["type"] == "error" and final["error"]["class"] == "infrastructure", final
    assert "object storage s3://nowhere/p/" in final["error"]["message"]


def test_keys_of_a_relative_data_dir_from_resolved_and_plain_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the supervisor holds the resumed checkpoint's path resolved, new ones plain
    store = storage.Store(Layout(Path("data")))
    resolved = write(store, "checkpoints/1/run-1-e00001-s000000.pt", b"ck").resolve()
    assert store.layout.rel(resolved) == "checkpoints/1/run-1-e00001-s000000.pt"
    store.delete(store.layout.rel(resolved))
    assert not resolved.exists()
