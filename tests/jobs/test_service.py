"""The product as users meet it: a real server and real worker processes, spoken to over HTTP."""
import json
import os
import signal
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from tests.helpers.backends import on_both_backends, on_sqlite_only
from tests.helpers.jobs import IRIS_JOB, tiny_job
from tests.helpers.service import ROOT, Service
from trainyard.app.spec import parse_spec
from trainyard.worker import nets

pytestmark = pytest.mark.slow  # starts the real server and workers
service_backend = on_both_backends()


def test_iris_train_predict_and_artifact(service, tmp_path):
    service.start_worker("cpu")
    job = service.submit(IRIS_JOB)
    assert job["state"] == "queued" and job["progress"] == {"epoch": 0, "epochs": 100}
    job = service.wait_state(job["id"])
    assert job["state"] == "succeeded", job
    assert job["device"] == "cpu" and job["attempt"] == 1 and job["runs"] == 1
    assert job["result"]["val_accuracy"] >= 0.9
    assert job["result"]["class_names"] == ["setosa", "versicolor", "virginica"]
    assert job["progress"] == {"epoch": 100, "epochs": 100}

    with service.client() as c:
        history = c.get(f"/jobs/{job['id']}/metrics").json()
        assert [m["epoch"] for m in history] == list(range(1, 101))
        assert all(m["train_loss"] > 0 and m["samples_per_s"] > 0 and m["seconds"] > 0 for m in history)
        assert history[-1]["val_accuracy"] == job["result"]["val_accuracy"]
        assert history[0]["train_loss"] > history[-1]["train_loss"]

        # The validation split, evaluated by a predict job, gives the same accuracy.
        ev = service.wait_state(service.submit(
            {"kind": "predict", "model_job": job["id"], "data": {"dataset": "iris", "split": "val"}})["id"])
        assert ev["state"] == "succeeded", ev
        result = c.get(f"/jobs/{ev['id']}/result").json()
        assert result["accuracy"] == job["result"]["val_accuracy"] and result["samples"] == 30
        assert sum(map(sum, result["confusion_matrix"])) == 30
        assert set(result["per_class_accuracy"]) == {"setosa", "versicolor", "virginica"}

        pred = service.wait_state(service.submit(
            {"kind": "predict", "model_job": job["id"], "inputs": [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]})["id"])
        out = c.get(f"/jobs/{pred['id']}/result").json()
        assert [p["class"] for p in out["predictions"]] == ["setosa", "virginica"]
        assert all(abs(sum(p["probabilities"]) - 1) < 1e-5 for p in out["predictions"])
        assert pred["result"]["predictions"] == 2  # the job itself carries a summary

        # The artifact loads into a freshly built model on the CPU, with no unpickling.
        st = c.get(f"/jobs/{job['id']}/artifact")
        assert st.status_code == 200
        (tmp_path / "m.safetensors").write_bytes(st.content)
        (tmp_path / "m.pt").write_bytes(c.get(f"/jobs/{job['id']}/artifact", params={"format": "pt"}).content)
        meta = c.get(f"/jobs/{job['id']}/artifact", params={"format": "meta"}).json()
    spec = parse_spec(meta["spec"])
    fresh = nets.build_model(spec.model, tuple(meta["input_shape"]), meta["num_classes"])
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "m.safetensors", device="cpu"))
    other = nets.build_model(spec.model, tuple(meta["input_shape"]), meta["num_classes"])
    other.load_state_dict(torch.load(tmp_path / "m.pt", map_location="cpu", weights_only=True))
    x = torch.tensor([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]])
    probs = torch.softmax(fresh(x), dim=1)
    assert probs.argmax(1).tolist() == [0, 2]
    assert torch.equal(fresh(x), other(x))
    assert torch.allclose(probs, torch.tensor([p["probabilities"] for p in out["predictions"]]), atol=1e-5)


@on_sqlite_only
def test_cnn_on_digits_reaches_90_percent(service):
    service.start_worker("cpu")
    job = service.submit({"kind": "train", "name": "digits-cnn", "model": {"arch": "cnn"},
                          "data": {"dataset": "digits"}, "train": {"epochs": 8, "batch_size": 64, "lr": 0.003}})
    job = service.wait_state(job["id"], timeout=300)
    assert job["state"] == "succeeded", job
    assert job["result"]["val_accuracy"] >= 0.9
    assert job["result"]["input_shape"] == [1, 8, 8]


def test_two_workers_share_one_database_and_run_each_job_once(service):
    service.start_worker("cpu")
    service.start_worker("cpu")
    ids = [service.submit(tiny_job(epochs=1))["id"] for _ in range(20)]
    jobs = [service.wait_state(i, timeout=180) for i in ids]
    assert all(j["state"] == "succeeded" and j["runs"] == 1 and j["attempt"] == 1 for j in jobs), jobs
    assert len({j["worker_id"] for j in jobs}) == 2  # both really worked
    with service.client() as c:
        for i in ids:
            assert len(c.get(f"/jobs/{i}/metrics").json()) == 1
            log = c.get(f"/jobs/{i}/logs").text
            assert log.count("attempt ") == 1 and "(run 1)" in log
            # Two CPU workers on one host share its cores instead of oversubscribing them.
            assert f"{max(1, os.cpu_count() // 2)} torch threads" in log


def test_devices_workers_and_listing(service):
    worker = service.start_worker("cpu")
    with service.client() as c:
        d = c.get("/devices").json()
        assert d["cuda_available"] is False and d["cuda_devices"] == []
        assert d["cpu"]["cores"] >= 1 and d["cpu"]["memory_total"] > 0
        assert [w["pid"] for w in d["cpu"]["workers"]] == [worker.pid]
        assert d["torch_version"].startswith("2.14.1")
        ws = c.get("/workers").json()
        assert ws[0]["device"] == "cpu" and ws[0]["state"] in ("idle", "busy")

        a = service.submit(tiny_job())
        b = service.submit({**tiny_job(), "device": "cuda:3"})  # no such worker: stays queued
        service.wait_state(a["id"], "succeeded")
        page = c.get("/jobs", params={"limit": 1}).json()
        assert page["count"] == 2 and [j["id"] for j in page["data"]] == [b["id"]]
        assert [j["id"] for j in c.get("/jobs", params={"state": "queued"}).json()["data"]] == [b["id"]]
        assert c.get("/jobs", params={"kind": "predict"}).json()["count"] == 0
        assert c.get("/jobs", params={"limit": 1, "offset": 1}).json()["data"][0]["id"] == a["id"]
        # List items are light: no spec, errors or result unless asked for.
        light = c.get("/jobs", params={"state": "succeeded"}).json()["data"][0]
        assert not {"spec", "errors", "result"} & set(light) and light["requested_device"] == "cpu"
        full = c.get(f"/jobs/{a['id']}").json()
        # ... nor its MLflow run, which only GET /jobs/{id} reads (null: the service tracks nothing).
        assert full["tracking"] is None and "tracking" not in light
        assert {k: v for k, v in full.items() if k not in ("spec", "errors", "result", "tracking")} == light
        some = c.get("/jobs", params={"state": "succeeded", "include": "result,spec"}).json()["data"][0]
        assert some == {**light, "spec": full["spec"], "result": full["result"]}
        bad = c.get("/jobs", params={"include": "spec,traceback"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "include"]
        assert c.post(f"/jobs/{b['id']}/cancel").json()["state"] == "cancelled"
        assert c.post(f"/jobs/{b['id']}/cancel").status_code == 409
        assert c.get("/docs").status_code == 200
        schema = c.get("/openapi.json").json()
        examples = schema["paths"]["/jobs"]["post"]["requestBody"]["content"]["application/json"]["examples"]
        assert examples["train"]["value"]["model"]["arch"] == "mlp"


@on_sqlite_only
def test_cli_submit_wait_status_download(service, tmp_path):
    service.start_worker("cpu")
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(tiny_job(epochs=3)))
    env = {**service.env}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    r = cli("submit", str(spec), "--wait", "--json")
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)
    assert job["state"] == "succeeded" and job["progress"]["epoch"] == 3
    assert "succeeded" in cli("status", str(job["id"])).stdout
    listing = cli("jobs")
    assert listing.returncode == 0 and "succeeded" in listing.stdout
    out = tmp_path / "model.safetensors"
    assert cli("download", str(job["id"]), "-o", str(out)).returncode == 0
    with service.client() as c:
        assert out.read_bytes() == c.get(f"/jobs/{job['id']}/artifact").content
    assert all(t.dtype == torch.float32 for t in safetensors.torch.load_file(out).values())
    assert json.loads(cli("devices", "--json").stdout)["cuda_available"] is False
    bad = cli("status", "9999")
    assert bad.returncode == 1 and "not found" in bad.stderr


def test_up_runs_server_and_worker_and_stops_on_ctrl_c(tmp_path):
    svc = Service(tmp_path / "data")
    # From a directory of the user's, with the data dir relative to it (the processes start elsewhere).
    up = subprocess.Popen([sys.executable, "-m", "trainyard", "up", "--port", str(svc.port)], cwd=tmp_path,
                          env={**svc.env, "TRAINYARD_DATA_DIR": "data"}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    try:
        svc.wait_until(lambda: _workers(svc) == 1, 120, "trainyard up: server and one worker")
        job = svc.wait_state(svc.submit(tiny_job())["id"])
        assert job["state"] == "succeeded"
        assert (tmp_path / "data" / "logs" / f"{job['id']}.log").is_file()  # the worker's data dir is that one
        children = subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2  # the server and the worker
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
        assert up.wait(timeout=60) == 0
    # Its start-up line says where the dashboard, the API's docs and its health check are.
    said = up.stderr.read() if up.stderr else ""
    assert f"dashboard at http://127.0.0.1:{svc.port}/," in said and "/docs" in said and "/healthz" in said, said
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


def _workers(svc) -> int:
    try:
        with svc.client() as c:
            return len(c.get("/workers").json())
    except Exception:
        return 0
