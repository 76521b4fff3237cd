"""What the store holds, as the API, /metrics, the client, the CLI and the OpenAPI document say it (GET /storage,
POST /storage/collect, trainyard_storage_*), checked against a listing of the real server's data directory after a
job ran, a dataset was uploaded and a model exported; the collector's counters counting the orphans it removed;
and a sweep trial whose files retention reclaimed answering 410 with the reason."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import update

from tests.helpers.jobs import tiny_job
from tests.helpers.openapi import conforms
from tests.helpers.prometheus import parse, value
from tests.helpers.service import live_service
from trainyard.app.client import APIError, Client
from trainyard.app.core.layout import EXPORT_FILES
from trainyard.app.db import jobs, make_engine, write
from trainyard.app.lifecycle.collector import KINDS

pytestmark = pytest.mark.slow  # the real server and a CPU worker

TRAINYARD = Path(sys.executable).with_name("trainyard")  # the console script pip installed
RULES = {"TRAINYARD_CHECKPOINT_TTL_S": "3600", "TRAINYARD_LOG_TTL_S": "172800", "TRAINYARD_SWEEP_KEEP_BEST": "3"}
FOLDERS = {"artifacts": "artifacts", "checkpoints": "checkpoints", "logs": "logs", "uploads": "datasets/uploads",
           "cache": "datasets/cache"}
WHY = "not among sweep 7's best 3 trials (keep_best)"


live = live_service(env=RULES)


def listing(data: Path) -> dict[str, dict[str, int]]:
    """The data directory's files by kind, read here: exports are the artifacts folder's exported models, the
    cache the decoded datasets (never hidden files); jobs' TensorBoard event files count as artifacts."""
    found = {kind: {"bytes": 0, "objects": 0} for kind in KINDS}
    for kind, folder in [*FOLDERS.items(), ("artifacts", "tensorboard")]:
        for path in (data / folder).rglob("*"):
            if not path.is_file() or (kind == "cache" and path.name.startswith(".")):
                continue
            shown = "exports" if kind == "artifacts" and path.name.lstrip(".").startswith(
                tuple(EXPORT_FILES.values())) else kind
            found[shown]["bytes"] += path.stat().st_size
            found[shown]["objects"] += 1
    return found


def orphan(data: Path, key: str, size: int) -> None:
    """A file no row names, older than the grace period (as a crash would leave it)."""
    path = data / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    old = time.time() - 3600
    os.utime(path, (old, old))


def cli(svc, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(TRAINYARD), *args], env=svc.env, capture_output=True, text=True, timeout=120)


def storage_samples(svc) -> dict:
    with svc.client() as c:
        types, samples = parse(c.get("/metrics").text)
    assert types["trainyard_storage_bytes"] == types["trainyard_storage_objects"] == "gauge"
    return samples


def test_before_a_pass_every_kind_is_zero_and_unmeasured(live):
    with Client(live.url) as client:
        before = client.storage.get()
    assert list(before.kinds) == list(KINDS)
    assert all(u == {"bytes": 0, "objects": 0} for u in before.kinds.values()) and before.measured_at is None
    samples = storage_samples(live)
    for kind in KINDS:
        assert value(samples, "trainyard_storage_bytes", kind=kind) == 0
        assert value(samples, "trainyard_storage_objects", kind=kind) == 0


def test_the_measure_is_the_data_directory_everywhere(live, tmp_path):
    data = live.data_dir
    job = live.wait_state(live.submit(tiny_job())["id"])
    assert job["state"] == "succeeded"
    with live.client() as c:
        assert c.get(f"/jobs/{job['id']}/artifact", params={"format": "torchscript"}).status_code == 200
        csv = "a,b,label\n" + "".join(f"{i},{i % 3},{'xy'[i % 2]}\n" for i in range(40))
        assert c.post("/datasets", files={"file": ("d.csv", csv)}, data={"label_column": "label"}).status_code == 201
        document = c.get("/openapi.json").json()
    orphan(data, "artifacts/999999/run-1/model.safetensors", 1000)
    orphan(data, "checkpoints/999999/run-1-epoch-1.pt", 300)
    before = storage_samples(live)

    with Client(live.url) as client:
        report = client.storage.collect()
        got = client.storage.get()
    conforms(document, "collect_storage", 200, report)
    conforms(document, "get_storage", 200, got)
    assert not (data / "artifacts" / "999999").exists() and not (data / "checkpoints" / "999999").exists()
    assert report.deleted_objects == 2 and report.deleted_bytes == 1300, report
    expected = listing(data)
    assert expected["exports"]["objects"] == 1 and expected["uploads"]["objects"] >= 2, expected
    assert all(expected[k]["objects"] for k in ("artifacts", "logs")), expected
    assert report.usage == got.kinds == expected and list(got.kinds) == list(KINDS)
    assert got.measured_at is not None and got.store == str(data.resolve())
    assert got.rules["checkpoint_ttl_s"] == 3600 and got.rules["log_ttl_s"] == 172800
    assert got.rules["sweep_keep_best"] == 3 and set(got.rules) == {
        "checkpoint_ttl_s", "ended_job_ttl_s", "sweep_keep_best", "log_ttl_s", "export_ttl_s", "cache_bytes",
        "collect_s", "collect_grace_s"}

    after = storage_samples(live)
    for kind in KINDS:
        assert value(after, "trainyard_storage_bytes", kind=kind) == expected[kind]["bytes"]
        assert value(after, "trainyard_storage_objects", kind=kind) == expected[kind]["objects"]
    assert "cache" not in {dict(labels).get("kind") for name, labels in after if name.startswith(
        "trainyard_storage_deleted")}
    for kind, removed, size in (("artifacts", 1, 1000), ("checkpoints", 1, 300), ("logs", 0, 0)):
        for name, n in (("trainyard_storage_deleted_objects_total", removed),
                        ("trainyard_storage_deleted_bytes_total", size)):
            assert value(after, name, kind=kind) - value(before, name, kind=kind) == n, (name, kind)
    passes = "trainyard_storage_collections_total"
    assert value(after, passes) - value(before, passes) == 1
    with live.client() as c:
        ops = {(m, p): o["operationId"] for p, methods in c.get("/openapi.json").json()["paths"].items()
               for m, o in methods.items()}
    assert ops[("get", "/storage")] == "get_storage" and ops[("post", "/storage/collect")] == "collect_storage"


def test_the_cli_shows_and_collects(live):
    r = cli(live, "storage", "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert list(shown["kinds"]) == list(KINDS) and set(shown) == {"store", "kinds", "project", "measured_at", "rules"}
    assert shown["project"] is None  # the admin's answer: the whole store (a member's: docs/teams.md)
    r = cli(live, "storage", "collect", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["usage"] == listing(live.data_dir) and report["deleted_objects"] == 0

    r = cli(live, "storage")  # people's: the kinds with their sizes, and the rules
    assert r.returncode == 0, r.stderr
    rows = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.count("│") >= 3}
    assert set(KINDS) <= set(rows) and "log_ttl_s" in rows and "2 d" in rows["log_ttl_s"], r.stdout
    assert rows["checkpoint_ttl_s"].split("│")[2].strip() == "1 h" and "measured " in r.stdout
    assert rows["artifacts"].split("│")[2].strip().endswith("KiB"), rows["artifacts"]
    r = cli(live, "storage", "collect")
    assert r.returncode == 0 and r.stdout.startswith("collected in "), r.stdout
    r = cli(live, "storage", "compact", "--json")
    assert r.returncode == 2 and "invalid choice" in json.loads(r.stderr)["error"]["detail"]


def test_a_reclaimed_trials_model_answers_410_saying_why(live):
    job = live.wait_state(live.submit(tiny_job())["id"])
    engine = make_engine(f"sqlite:///{live.data_dir.resolve() / 'trainyard.db'}")
    try:
        with write(engine) as conn:  # what retention does to a trial outside its sweep's best k
            conn.execute(update(jobs).where(jobs.c.id == job["id"]).values(
                artifact_path=None, checkpoint_path=None, reclaimed={"at": time.time(), "why": WHY}))
    finally:
        engine.dispose()
    with live.client() as c:
        for fmt in ("safetensors", "onnx"):
            r = c.get(f"/jobs/{job['id']}/artifact", params={"format": fmt})
            assert r.status_code == 410 and WHY in r.json()["detail"] and "retention" in r.json()["detail"], r.text
    with Client(live.url) as client, pytest.raises(APIError) as caught:
        client.jobs.download(job["id"], live.data_dir / "model.safetensors")
    assert caught.value.status_code == 410 and WHY in str(caught.value.detail)
    with live.client() as c:  # nor may a predict job use it
        r = c.post("/jobs", json={"kind": "predict", "model_job": job["id"], "inputs": [[5.1, 3.5, 1.4, 0.2]]})
    assert r.status_code == 422 and "removed by retention" in r.text and WHY in r.text, r.text
