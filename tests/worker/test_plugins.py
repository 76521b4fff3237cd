"""Your own model, data and training program, installed as plugins (examples/plugin, which `make
setup` installs), run by real workers over HTTP with every guarantee the built-in jobs have."""
import os
import re
import signal
import time

import pytest

from tests.helpers.jobs import IRIS_JOB, tiny_job
from tests.helpers.processes import alive, job_pids
from tests.helpers.service import Service
from trainyard import APIError, Client

pytestmark = pytest.mark.slow


def cifar(epochs: int, **config) -> dict:
    return {"kind": "run", "entrypoint": "cifar_loop", "device": "cpu",
            "config": {"epochs": epochs, "size": 200, "batch_size": 20, **config}}


def metrics(svc, job_id) -> list[dict]:
    with svc.client() as c:
        return c.get(f"/jobs/{job_id}/metrics").json()


def test_the_catalog_lists_installed_plugins(live):
    with live.client() as c:
        plugins = {(p["kind"], p["name"]): p for p in c.get("/catalog").json()["plugins"]}
    assert set(plugins) == {("models", "tinynet"), ("datasets", "blobs"), ("entrypoints", "cifar_loop")}
    p = plugins[("models", "tinynet")]
    assert p["distribution"] == "trainyard-example-plugin" and p["version"] == "0.1.0"
    assert "this server" in p["installed_on"] and any(w.startswith(os.uname().nodename) for w in p["installed_on"])


def test_a_plugin_model_trains_on_a_builtin_dataset_and_serves_predictions(live):
    job = live.wait_state(live.submit({**IRIS_JOB, "model": {"arch": "tinynet", "params": {"width": 16}},
                                       "device": "cpu"})["id"])
    assert job["state"] == "succeeded" and job["result"]["val_accuracy"] >= 0.9, job
    assert job["parameters"] is None and job["result"]["parameters"] == 4 * 16 + 16 + 16 * 3 + 3
    with live.client() as c:
        meta = c.get(f"/jobs/{job['id']}/artifact", params={"format": "meta"}).json()
        assert meta["model"] == {"arch": "tinynet", "params": {"width": 16}, "num_classes": None}
    pred = live.wait_state(live.submit({"kind": "predict", "model_job": job["id"],
                                        "inputs": [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]})["id"])
    ev = live.wait_state(live.submit({"kind": "predict", "model_job": job["id"],
                                      "data": {"dataset": "iris", "split": "val"}})["id"])
    with live.client() as c:
        predictions = c.get(f"/jobs/{pred['id']}/result").json()["predictions"]
        assert [p["class"] for p in predictions] == ["setosa", "virginica"]
        assert c.get(f"/jobs/{ev['id']}/result").json()["accuracy"] == job["result"]["val_accuracy"]


def test_a_plugin_dataset_trains_a_builtin_model(live):
    body = {"kind": "train", "model": {"arch": "mlp", "hidden": [16]}, "device": "cpu",
            "data": {"dataset": "blobs", "params": {"n": 240, "classes": 4, "seed": 3}},
            "train": {"epochs": 30, "batch_size": 32, "lr": 0.01}}
    job = live.wait_state(live.submit(body)["id"])
    assert job["state"] == "succeeded" and job["result"]["class_names"] == ["blob0", "blob1", "blob2", "blob3"]
    assert job["result"]["val_accuracy"] >= 0.9 and job["result"]["input_shape"] == [5]
    ev = live.wait_state(live.submit({"kind": "predict", "model_job": job["id"],
                                      "data": {"dataset": "blobs", "split": "val"}})["id"])
    with live.client() as c:
        assert c.get(f"/jobs/{ev['id']}/result").json()["accuracy"] == job["result"]["val_accuracy"]


@pytest.mark.parametrize("body,field", [
    ({**tiny_job(), "model": {"arch": "nosuchnet"}}, ["body", "model", "arch"]),
    ({**tiny_job(), "data": {"dataset": "nosuchdata"}}, ["body", "data", "dataset"]),
    ({"kind": "run", "entrypoint": "nosuchprogram"}, ["body", "entrypoint"]),
    ({**tiny_job(), "model": {"arch": "mlp", "params": {"x": 1}}}, ["body", "model"]),
])
def test_unknown_plugin_names_are_422_naming_the_field(live, body, field):
    with live.client() as c:
        r = c.post("/jobs", json=body)
    assert r.status_code == 422, r.text
    locs = [d["loc"] for d in r.json()["detail"]]
    assert any(loc[:len(field)] == field or loc[-1] == field[-1] for loc in locs), locs
    if "nosuch" in r.text:
        assert "installed" in r.text


def test_a_run_job_reports_checkpoints_saves_a_model_and_the_client_drives_it(live):
    with Client(live.url) as client:
        job = client.jobs.submit(cifar(3))
        states = [e["data"]["state"] for e in client.jobs.events(job["id"]) if e["event"] == "state"]
        done = client.jobs.wait(job["id"], timeout=120)
        assert done["state"] == "succeeded" and states[-1] == "succeeded", done
        assert done["progress"] == {"epoch": 3, "epochs": 3}
        assert done["result"]["epochs"] == 3 and 0 <= done["result"]["val_accuracy"] <= 1
        history = client.jobs.metrics(job["id"])
        assert [m["epoch"] for m in history] == [1, 2, 3] and all(m["train_loss"] > 0 for m in history)
        weights = client.jobs.download(job["id"], live.data_dir.parent / "run.safetensors")
        assert weights.stat().st_size > 200_000
        pred = client.jobs.wait(client.jobs.submit({"kind": "predict", "model_job": job["id"],
                                          "inputs": [[128.0] * 3072], "top_k": 2})["id"], timeout=60)
        assert pred["state"] == "succeeded"
        assert len(client.jobs.result(pred["id"])["predictions"][0]["top"]) == 2
        assert "resumed" not in client.jobs.logs(job["id"])
        with pytest.raises(APIError) as e:
            client.jobs.get(999_999)
        assert e.value.status_code == 404 and "not found" in str(e.value.detail)


def test_a_run_job_sigkilled_mid_run_resumes_from_restore_on_another_worker(tmp_path):
    svc = Service(tmp_path / "data").start_server()
    try:
        a = svc.start_worker("cpu")
        job = svc.submit(cifar(10, step_sleep=0.02))
        svc.wait_until(lambda: (svc.job(job["id"])["checkpoint_epoch"] or 0) >= 2, 120, "checkpoint 2")
        os.kill(a.pid, signal.SIGKILL)
        svc.start_worker("cpu")
        done = svc.wait_state(job["id"], timeout=240)
        assert done["state"] == "succeeded" and done["runs"] == 2, done
        assert done["errors"][0]["class"] == "infrastructure"
        history = metrics(svc, job["id"])
        assert [m["epoch"] for m in history] == list(range(1, 11))  # no gap, no duplicate
        resumed = int(re.search(r"resumed after epoch (\d+)", svc_logs(svc, job["id"])).group(1))
        assert resumed >= 2
        assert {m["attempt"] for m in history if m["epoch"] <= resumed} == {1}
        assert {m["attempt"] for m in history if m["epoch"] > resumed} == {2}
    finally:
        svc.stop()


def svc_logs(svc, job_id) -> str:
    with svc.client() as c:
        return c.get(f"/jobs/{job_id}/logs").text


def test_a_run_job_is_requeued_on_sigterm_and_cancelled_within_two_seconds(tmp_path):
    svc = Service(tmp_path / "data").start_server()
    try:
        a = svc.start_worker("cpu")
        job = svc.submit(cifar(50, step_sleep=0.02))
        svc.wait_until(lambda: (svc.job(job["id"])["checkpoint_epoch"] or 0) >= 1, 120, "first checkpoint")
        os.kill(a.pid, signal.SIGTERM)
        assert a.wait(timeout=30) == 0
        back = svc.job(job["id"])
        assert back["state"] == "queued" and back["attempt"] == 0, back
        svc.start_worker("cpu")
        svc.wait_until(lambda: svc.job(job["id"])["runs"] == 2 and svc.job(job["id"])["state"] == "running", 60,
                       "the second run")
        svc.wait_until(lambda: len(job_pids(svc, job["id"])) == 2, 30, "the second job process")
        pid = job_pids(svc, job["id"])[-1]
        time.sleep(1.0)  # inside the user's loop
        t0 = time.monotonic()
        with svc.client() as c:
            assert c.post(f"/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
        svc.wait_until(lambda: not alive(pid), 2.0, "the cancelled run job's process to exit")
        assert time.monotonic() - t0 < 2.5
        assert svc.job(job["id"])["state"] == "cancelled"
    finally:
        svc.stop()


def test_jobs_wait_for_a_worker_that_has_their_plugins(tmp_path):
    svc = Service(tmp_path / "data").start_server()
    try:
        svc.start_worker("cpu", env={"TRAINYARD_PLUGINS": ""})  # offers no plugin
        plain = svc.submit(tiny_job())
        needs = svc.submit({**tiny_job(), "model": {"arch": "tinynet"}})
        assert svc.wait_state(plain["id"])["state"] == "succeeded"
        time.sleep(2)
        assert svc.job(needs["id"])["state"] == "queued"  # not failed on the worker without it
        svc.start_worker("cpu")
        done = svc.wait_state(needs["id"])
        assert done["state"] == "succeeded" and done["runs"] == 1
        assert done["worker_id"] != svc.job(plain["id"])["worker_id"]
    finally:
        svc.stop()


def test_a_run_job_on_two_devices_trains_with_ddp_stops_together_and_resumes(tmp_path):
    """Your own program on two CPU ranks: ctx.parallel, a DistributedSampler, the ranks' stop vote; a
    SIGTERM reaches rank 0 only, yet every rank leaves, and the job resumes on two devices from restore()."""
    svc = Service(tmp_path / "data").start_server()
    try:
        svc.start_worker("cpu")
        svc.start_worker("cpu")
        job = svc.submit({**cifar(12, step_sleep=0.01), "devices": 2})
        svc.wait_until(lambda: (svc.job(job["id"])["checkpoint_epoch"] or 0) >= 1, 120, "first checkpoint")
        running = svc.job(job["id"])
        assert len(running["ranks"]) == 2
        leader = next(w for w in svc.client().get("/workers").json() if w["id"] == running["ranks"][0]["worker"])
        pids = [int(p) for p in re.findall(r"rank 1 pid (\d+)", svc_logs(svc, job["id"]))] + job_pids(svc, job["id"])
        os.kill(leader["pid"], signal.SIGTERM)
        svc.wait_until(lambda: svc.job(job["id"])["state"] == "queued", 30, "the job to be requeued")
        svc.wait_until(lambda: not any(alive(p) for p in pids), 10, "every rank to exit")
        svc.start_worker("cpu")
        done = svc.wait_state(job["id"], timeout=240)
        assert done["state"] == "succeeded" and done["runs"] == 2, done
        assert [m["epoch"] for m in metrics(svc, job["id"])] == list(range(1, 13))
        assert re.search(r"resumed after epoch (\d+)", svc_logs(svc, job["id"]))
        assert len(done["ranks"]) == 2
    finally:
        svc.stop()
