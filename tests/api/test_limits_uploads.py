"""Uploads that used to cost the server gigabytes or minutes, sent for real to a live server; the
server's peak memory is read from /proc, stored bytes from the disk, time from the clock.
The inputs are bench/limits.py's, which measures the same probes against any checkout."""
import io
import os
import threading
import time

import numpy as np
import pytest

from bench.limits import csv_long_label, csv_wide, disk, npz_zeros, zip_entries, zip_inflating
from tests.helpers.data import iris_csv
from tests.helpers.jobs import tiny_job
from tests.helpers.processes import peak_rss, reset_peak
from tests.helpers.service import Service, live_service
from trainyard.app import uploads
from trainyard.app.core import errors
from trainyard.worker import dataset_cache

pytestmark = pytest.mark.slow
MiB = 1 << 20
# Over the server's idle footprint while one upload is parsed and refused: the multipart form is
# spooled to disk and a refused upload decodes nothing past its bound.
SMALL = 40 * MiB


live = live_service(workers=0, env={"TRAINYARD_MAX_UPLOADS": "3"})


def post(live, name: str, content: bytes, **form):
    pid = live.server.pid
    reset_peak(pid)
    base, t0 = peak_rss(pid), time.perf_counter()
    with live.client(timeout=300) as c:
        r = c.post("/datasets", files={"file": (name, content)}, data=form)
    return r, peak_rss(pid) - base, time.perf_counter() - t0


def refused(r, status: int, field: str, *words: str) -> None:
    assert r.status_code == status, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", field], error
    for word in words:
        assert word in error["msg"], error["msg"]


def test_a_very_long_label_costs_nothing(live):
    content = csv_long_label(3000)  # 150 KB: it padded 3,000 labels to 131,000 characters, 1.6 GB
    r, grew, took = post(live, "long.csv", content, label_column="label")
    refused(r, 422, "label_column", "131,000 characters", "at most 200")
    assert grew < SMALL and took < 5, (grew, took)


def test_a_hundred_thousand_columns_are_refused_at_once_and_ten_thousand_are_linear(live):
    r, grew, took = post(live, "wide.csv", csv_wide(100_000), label_column="label")
    refused(r, 413, "file", "100,001 columns", "at most 10,000")
    assert grew < SMALL and took < 5, (grew, took)  # it took 175 s of server CPU
    header = ",".join(f"c{i}" for i in range(9_999)) + ",label\n"
    rows = "".join(",".join(str(i % 7) for _ in range(9_999)) + f",{'ab'[i % 2]}\n" for i in range(20))
    r, grew, took = post(live, "ok.csv", (header + rows).encode(), label_column="label")
    assert r.status_code == 201 and r.json()["input_shape"] == [9_999], r.text
    assert took < 10, took
    with live.client() as c:
        assert c.delete(f"/datasets/{r.json()['id']}").status_code == 204


def test_an_npz_of_zeros_is_refused_before_it_inflates(live):
    content = npz_zeros()  # 270 MB of uint8 in ~270 KB: stored as 1.08 GB float32 before
    before = disk(live.data_dir / "datasets")
    r, grew, took = post(live, "zeros.npz", content)
    refused(r, 413, "file", "inflates to")
    assert grew < SMALL and took < 10, (grew, took)
    assert disk(live.data_dir / "datasets") - before < 4096  # nothing but the lock file


def test_uint8_images_are_stored_as_uint8_compressed(live):
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 4, size=(400, 1, 28, 28)) * 60).astype(np.uint8)  # few levels: compressible
    buf = io.BytesIO()
    np.savez(buf, x=x, y=np.arange(400) % 4)
    r, grew, _ = post(live, "img.npz", buf.getvalue())
    assert r.status_code == 201, r.text
    meta = r.json()
    assert meta["pixels"] is True and meta["input_shape"] == [1, 28, 28]
    assert meta["stored_bytes"] < x.nbytes / 2  # uint8, compressed: not 4x as float32
    with np.load(live.data_dir / "datasets" / "uploads" / meta["id"] / "data.npz") as stored:
        assert stored["x"].dtype == np.uint8 and np.array_equal(stored["x"], x)
    with live.client() as c:
        assert c.delete(f"/datasets/{meta['id']}").status_code == 204


def test_a_zip_member_inflating_to_a_gigabyte(live):
    content = zip_inflating((1 << 30) - MiB)  # ~1 MB; the member was read whole: a 2 GB peak
    assert len(content) < 2 * MiB
    r, grew, took = post(live, "bomb.zip", content)
    refused(r, 413, "file", "inflates to 1,023.0 MiB")
    assert grew < SMALL and took < 10, (grew, took)


def test_a_million_entries_are_refused_from_the_end_record(live):
    content = zip_entries(1_000_000)  # its directory cost 555 MB of ZipInfo objects before the 413
    r, grew, took = post(live, "many.zip", content)
    refused(r, 413, "file", "holds 1000000 files", "TRAINYARD_MAX_UPLOAD_FILES")
    assert grew < SMALL and took < 20, (grew, took)


def test_a_directory_fuller_than_its_count_is_refused(tmp_path):
    content = bytearray(zip_entries(20_000))
    # The zip64 record says 20,000; make it say 2, as a lying archive would.
    at = content.rfind(b"PK\x06\x06")
    content[at + 24:at + 40] = (2).to_bytes(8, "little") * 2
    with pytest.raises(errors.TooLarge, match="central directory of .* room for more than 100 files"):
        uploads.store(io.BytesIO(bytes(content)), "lying.zip", tmp_path, limits=uploads.Limits(max_files=100))


def test_upload_count_quota(live):
    with live.client() as c:
        for d in c.get("/datasets").json()["data"]:
            c.delete(f"/datasets/{d['id']}")
    for _ in range(3):
        r, _, _ = post(live, "iris.csv", iris_csv(), label_column="species")
        assert r.status_code == 201, r.text
    r, _, _ = post(live, "iris.csv", iris_csv(), label_column="species")
    refused(r, 413, "file", "at most 3", "TRAINYARD_MAX_UPLOADS")


def test_byte_quota_holds_under_concurrent_uploads(tmp_path):
    one = uploads.store(io.BytesIO(iris_csv()), "a.csv", tmp_path / "probe", "species")["stored_bytes"]
    limits = uploads.Limits(quota_bytes=int(2.5 * one))
    outcomes = []

    def send():
        try:
            outcomes.append(uploads.store(io.BytesIO(iris_csv()), "a.csv", tmp_path, "species", limits)["id"])
        except errors.TooLarge as e:
            outcomes.append(e)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = [o for o in outcomes if isinstance(o, str)]
    assert len(stored) == 2 and all("TRAINYARD_UPLOAD_QUOTA_BYTES" in str(o) for o in outcomes if o not in stored)
    assert sum(m["stored_bytes"] for m in uploads.list_all(tmp_path)) <= limits.quota_bytes


def test_cache_evicts_the_least_recently_used(tmp_path):
    for i, name in enumerate(("a", "b", "c")):
        (tmp_path / f"{name}.pt").write_bytes(b"\0" * 1000)
        os.utime(tmp_path / f"{name}.pt", (1000 + i, 1000 + i))
    os.utime(tmp_path / "a.pt")  # a was just used: b is now the least recently used
    removed = dataset_cache.evict(tmp_path, quota=2000, keep=tmp_path / "c.pt")
    assert removed == [tmp_path / "b.pt"] and sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "c.pt"]
    assert dataset_cache.evict(tmp_path, quota=0, keep=tmp_path / "c.pt") == [tmp_path / "a.pt"]  # never the new one


def test_fake_data_caches_stay_within_their_quota(tmp_path):
    """One cache file per split_seed grew without end; now the oldest go past the quota."""
    one = 200 * 3 * 32 * 32  # bytes of one cache entry's images (200 samples of 3x32x32)
    svc = Service(tmp_path / "data", env={"TRAINYARD_DATASET_CACHE_BYTES": str(int(2.5 * one))}).start_server()
    try:
        svc.start_worker("cpu")
        for seed in range(4):
            job = svc.submit({**tiny_job(epochs=1), "model": {"arch": "mlp", "hidden": [4]},
                              "data": {"dataset": "fake", "size": 200, "split_seed": seed}})
            assert svc.wait_state(job["id"])["state"] == "succeeded"
        cache = svc.data_dir / "datasets" / "cache"
        names = sorted(p.name for p in cache.iterdir())
        assert len(names) == 2 and names[-1].endswith("-3.pt") and disk(cache) <= 2.5 * one + 4096, names
    finally:
        svc.stop()
