"""This host's copies of bucket objects held to TRAINYARD_CACHE_BYTES (app/lifecycle/host_cache.py), against a real S3
protocol server (moto's): least recently used out, young and hidden files spared, the bucket untouched."""
import os
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch

from tests.helpers.jobs import tiny_job
from tests.helpers.service import Service
from trainyard.app.core import storage
from trainyard.app.core.layout import Layout, locked
from trainyard.app.lifecycle import host_cache

COPY_FOLDERS = ("artifacts", "checkpoints", "logs", "datasets/uploads")


@pytest.fixture
def store(bucket, tmp_path) -> storage.S3Store:
    return storage.S3Store(Layout(tmp_path / "host"), bucket.name, "p")


def put(store: storage.Store, key: str, size: int, age: float, publish: bool = True) -> Path:
    """A file of `size` bytes written here `age` seconds ago (and published, unless told not to)."""
    path = store.layout.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    if publish:
        store.publish(path)
    now = time.time()  # not the module's import time: a test may run minutes after it (xdist)
    os.utime(path, (now - age, now - age))
    return path


def here(store: storage.Store, keys: list[str]) -> list[str]:
    return [k for k in keys if (store.layout.root / k).exists()]


def copies_bytes(root: Path) -> int:
    """The bytes of root's copies, counted while the worker may be removing a run's scratch folder."""
    total = 0
    for folder in COPY_FOLDERS:
        for parent, _, files in os.walk(root / folder):  # a folder removed mid-walk is skipped, not an error
            for name in files:
                if not name.startswith("."):
                    try:
                        total += (Path(parent) / name).stat().st_size
                    except FileNotFoundError:
                        pass
    return total


KEYS = ["artifacts/1/run-1/model.safetensors", "checkpoints/2/run-1-e00001-s000005.pt", "logs/3.log",
        "datasets/uploads/abc/data.npz"]


def test_least_recently_used_go_first_and_a_fetch_hit_refreshes(store, bucket):
    for age, key in zip((400, 300, 200, 100), KEYS):
        put(store, key, 100, age)
    store.fetch(KEYS[0])  # the oldest, used now: the last to go
    assert host_cache.evict(store, cap_bytes=250, grace_s=50) == [KEYS[1], KEYS[2]]  # 400 bytes down to 200
    assert here(store, KEYS) == [KEYS[0], KEYS[3]]
    assert host_cache.measure(store) == (200, 2)
    # Only this host's copies went: the bucket keeps every object, fetched again on demand.
    assert bucket.keys() == sorted(f"p/{k}" for k in KEYS)
    assert len(store.fetch(KEYS[1]).read_bytes()) == 100
    assert here(store, KEYS) == [KEYS[0], KEYS[1], KEYS[3]]


def test_the_copies_end_under_the_cap(store):
    keys = [f"artifacts/{i}/run-1/model.pt" for i in range(12)]
    for i, key in enumerate(keys):
        put(store, key, 1000 + i, 1000 - i)  # job 0's the oldest
    cap = 5000
    evicted = host_cache.evict(store, cap, grace_s=0)
    total, files = host_cache.measure(store)
    assert total <= cap and total == copies_bytes(store.layout.root) and files == 12 - len(evicted)
    assert evicted == keys[:len(evicted)] and total + 1000 + len(evicted) - 1 > cap  # no more than needed
    assert host_cache.evict(store, cap, grace_s=0) == []  # under the cap: nothing more


def test_young_files_are_spared_even_past_the_cap(store):
    old = put(store, "artifacts/1/run-1/model.pt", 100, 700)
    young = [put(store, f"checkpoints/2/run-1-e0000{i}-s000005.pt", 100, 30, publish=False) for i in range(3)]
    assert host_cache.evict(store, cap_bytes=0, grace_s=60) == ["artifacts/1/run-1/model.pt"]
    assert not old.exists() and all(p.exists() for p in young)  # not published yet, maybe: never deleted
    assert host_cache.measure(store) == (300, 3)
    assert len(host_cache.evict(store, cap_bytes=0, grace_s=60, now=time.time() + 60)) == 3  # once past the grace


def test_hidden_files_and_other_folders_are_untouched(store):
    kept = [put(store, key, 50, 10_000, publish=False) for key in (
        "artifacts/1/run-1/.model.safetensors.x1y2.tmp", "checkpoints/1/.run-1-e00001-s000001.pt.ab.part",
        "logs/.7.log.q.tmp", "datasets/uploads/.abc/data.npz", "datasets/uploads/.uploads.lock",
        "scratch/4/run-1/out.bin", "datasets/cache/iris.pt", "datasets/raw/mnist.gz", "datasets/.iris.lock",
        "housekeeping.lock", "jobs.db")]
    put(store, "logs/9.log", 50, 10_000)
    assert host_cache.evict(store, cap_bytes=0, grace_s=0) == ["logs/9.log"]
    assert [p for p in kept if not p.exists()] == []
    assert host_cache.measure(store) == (50, 1)  # the decoded dataset is the one cache file left


def test_measure_counts_copies_and_decoded_datasets(store, tmp_path):
    for i, key in enumerate(KEYS):
        put(store, key, 10 * (i + 1), 100)
    put(store, "datasets/cache/digits.pt", 1000, 100, publish=False)
    put(store, "artifacts/1/run-1/.model.pt.z.tmp", 7, 0, publish=False)
    put(store, "scratch/1/run-1/x", 7, 0, publish=False)
    assert host_cache.measure(store) == (1100, 5)
    # With the data directory as the store, its files are the store, not a cache: the decoded datasets only.
    local = storage.Store(store.layout)
    assert host_cache.measure(local) == (1000, 1)


def test_the_data_directory_as_the_store_is_never_evicted(tmp_path):
    local = storage.Store(Layout(tmp_path / "data"))
    paths = [put(local, key, 100, 10_000) for key in KEYS]
    assert host_cache.evict(local, cap_bytes=0, grace_s=0) == []
    assert all(p.exists() for p in paths)


def test_processes_of_a_host_take_turns(store):
    put(store, "logs/1.log", 100, 1000)
    held = threading.Event()

    def hold():
        with locked(store.layout.dataset_lock("host-cache")):
            held.set()
            time.sleep(0.5)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    started = time.monotonic()
    assert host_cache.evict(store, 0, 0) == ["logs/1.log"]
    assert time.monotonic() - started >= 0.4  # waited for the other holder
    t.join()


@pytest.mark.slow
def test_a_worker_keeps_its_copies_under_the_cap(tmp_path, bucket):
    """The worker on a disk of its own (another host): after each run, its least recently used copies go,
    and every model is still served from the bucket, and fetched again by a job that needs it there."""
    cap = 12_000
    svc = Service(tmp_path / "api", f"sqlite:///{tmp_path / 'jobs.db'}",
                  env={**bucket.env, "TRAINYARD_STORAGE_URL": bucket.url, "TRAINYARD_CACHE_BYTES": str(cap),
                       "TRAINYARD_COLLECT_GRACE_S": "0"}).start_server()
    worker = tmp_path / "worker"
    try:
        svc.start_worker("cpu", env={"TRAINYARD_DATA_DIR": str(worker)})
        jobs = [svc.submit(tiny_job(epochs=2))["id"] for _ in range(5)]
        assert [svc.wait_state(j)["state"] for j in jobs] == ["succeeded"] * 5
        written = sum(o["Size"] for o in bucket.client().list_objects_v2(Bucket=bucket.name)["Contents"])
        assert written > 2 * cap  # without eviction, the worker's copies would be over the cap
        svc.wait_until(lambda: copies_bytes(worker) <= cap, 30, "the worker's copies under the cap")
        assert not list((worker / "artifacts" / str(jobs[0])).rglob("model.*"))  # the oldest went
        pred = svc.submit({"kind": "predict", "model_job": jobs[0], "data": {"dataset": "iris", "split": "all"}})
        assert svc.wait_state(pred["id"])["state"] == "succeeded"  # its model fetched again from the bucket
        svc.wait_until(lambda: copies_bytes(worker) <= cap, 30, "the worker's copies under the cap")
        with svc.client() as c:
            for j in jobs:
                art = c.get(f"/jobs/{j}/artifact")
                assert art.status_code == 200 and art.headers["content-length"] == str(len(art.content))
                assert safetensors.torch.load(art.content)
            assert c.get(f"/jobs/{pred['id']}/result").json()["samples"] == 150
    finally:
        svc.stop()


def test_a_running_jobs_log_evicted_while_it_ran_quiet_comes_back_whole(bucket, tmp_path):
    from trainyard.app.core.settings import Settings
    from trainyard.worker.supervisor.joblog import JobOutput
    settings = Settings(data_dir=tmp_path / "host", storage_url=f"s3://{bucket.name}/p")
    out = JobOutput(settings.layout.log(7), settings, 7, None)
    out.line("epoch 1 of a long run")
    out.publish()
    settings.layout.log(7).unlink()  # evicted: older than the grace period, published unchanged
    out.publish()  # nothing changed: no error, and the bucket's copy stays
    out.line("epoch 2")
    out.publish()
    assert settings.store.read_bytes("logs/7.log") == b"epoch 1 of a long run\nepoch 2\n"
