"""A job's event files packed as GET /jobs/{id}/tensorboard's .tar.gz (app/jobs/event_archive.py), from the data
directory and from a bucket: members <job>/<file> holding the stored bytes, temporaries left out, a file gone since
the listing left out, one grown since packed at its listed size."""
import io
import tarfile

import pytest

from trainyard.app.core.layout import Layout
from trainyard.app.core.storage import S3Store, Store
from trainyard.app.jobs import event_archive


def members(chunks) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def written(store: Store, job_id: int, files: dict[str, bytes]) -> None:
    folder = store.layout.tensorboard(job_id)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
        store.publish(folder / name)


@pytest.fixture(params=["data dir", "bucket"])
def store(request, tmp_path):
    layout = Layout(tmp_path / "data")
    if request.param == "data dir":
        return Store(layout)
    bucket = request.getfixturevalue("bucket")
    return S3Store(layout, bucket.name, "trainyard")


def test_the_archive_holds_every_runs_file_under_the_jobs_id(store):
    files = {"events.out.tfevents.1.h.1.0.run-1": b"first" * 1000, "events.out.tfevents.2.h.2.0.run-2": b"second",
             ".events.out.tfevents.3.h.3.0.run-3.part": b"half-written"}
    written(store, 7, files)
    written(store, 8, {"events.out.tfevents.1.h.1.0.run-1": b"another job's"})
    entries = event_archive.event_files(store, 7)
    assert [e.key.rpartition("/")[2] for e in entries] == sorted(n for n in files if not n.startswith("."))
    assert members(event_archive.archive(store, 7, entries)) == {
        f"7/{n}": data for n, data in files.items() if not n.startswith(".")}
    assert event_archive.event_files(store, 9) == []


def test_files_gone_or_grown_since_the_listing(tmp_path):
    store = Store(Layout(tmp_path / "data"))
    written(store, 7, {"a.tfevents.run-1": b"kept", "b.tfevents.run-2": b"12345"})
    entries = event_archive.event_files(store, 7)
    (store.layout.tensorboard(7) / "a.tfevents.run-1").unlink()  # the collector, meanwhile
    with open(store.layout.tensorboard(7) / "b.tfevents.run-2", "ab") as f:  # a run still writing
        f.write(b"678")
    assert members(event_archive.archive(store, 7, entries)) == {"7/b.tfevents.run-2": b"12345"}
