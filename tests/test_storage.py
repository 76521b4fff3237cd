"""The store (app/storage.py) against the data directory and against a real S3 protocol server (moto's),
and uploads kept in a bucket as two hosts see them."""
import io
import os

import pytest

from trainyard.app import storage, uploads
from trainyard.app.errors import Invalid, NotFound
from trainyard.app.layout import Layout
from trainyard.app.settings import Settings

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
