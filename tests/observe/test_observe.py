"""Watching jobs: Server-Sent Events, logs, Prometheus metrics, the catalog, and the CLI's live view."""
import json
import socket
import subprocess
import sys

import pytest

from tests.helpers.backends import on_both_backends, on_postgres_only, on_sqlite_only
from tests.helpers.jobs import tiny_job
from tests.helpers.service import ROOT
from trainyard import Client

pytestmark = pytest.mark.slow  # starts the real server and workers
service_backend = on_both_backends()

FAILING = {**tiny_job(), "model": {"arch": "cifar_net"}}  # iris rows are not 3x32x32 images


def read_events(service, job_id: int) -> list[tuple[str | None, dict]]:
    events: list[tuple[str | None, dict]] = []
    kind: str | None = None
    with service.client() as c, c.stream("GET", f"/jobs/{job_id}/events", timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
    return events


def test_events_stream_states_and_epochs_then_ends(service):
    job = service.submit(tiny_job(epochs=4))
    service.start_worker("cpu", wait=False)  # it takes seconds to start: the stream sees the job queued
    events = read_events(service, job["id"])  # returns only because the stream ends with the job
    kinds = [k for k, _ in events]
    assert kinds[-1] == "end" and events[-1][1] == {"id": job["id"], "state": "succeeded"}
    assert [e["state"] for k, e in events if k == "state"] == ["queued", "running", "succeeded"]
    epochs = [e for k, e in events if k == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3, 4] and all("train_loss" in e for e in epochs)
    with service.client() as c:
        assert c.get("/jobs/999/events").status_code == 404


@on_postgres_only
def test_a_reconnecting_client_resumes_after_the_last_event_id(service):
    service.start_worker("cpu")
    job = service.wait_state(service.submit(tiny_job(epochs=4))["id"])
    with Client(service.url) as client:
        full = list(client.jobs.events(job["id"]))
        assert [e["id"] for e in full if e["event"] == "epoch"] == ["1.1", "1.2", "1.3", "1.4"]
        later = list(client.jobs.events(job["id"], last_event_id="1.2"))
    assert [e["data"]["epoch"] for e in later if e["event"] == "epoch"] == [3, 4]
    # Nothing it had again: the run's opening state came before 1.2; the epochs left, the terminal state, the end.
    assert [e["event"] for e in later] == ["epoch", "epoch", "state", "end"]
    assert later[2]["data"]["state"] == "succeeded" and [e["id"] for e in later[:2]] == ["1.3", "1.4"]


@on_sqlite_only
def test_logs_hold_training_output_and_the_traceback(service):
    service.start_worker("cpu")
    ok = service.wait_state(service.submit(tiny_job(epochs=3))["id"])
    bad = service.wait_state(service.submit(FAILING)["id"])
    assert bad["state"] == "failed" and bad["error"]["class"] == "job"
    with service.client() as c:
        log = c.get(f"/jobs/{ok['id']}/logs").text
        assert "training mlp" in log and "epoch 3/3" in log
        log = c.get(f"/jobs/{bad['id']}/logs").text
        assert "Traceback" in log and bad["error"]["type"] in log


@on_sqlite_only
def test_prometheus_metrics(service):
    service.start_worker("cpu")
    service.wait_state(service.submit(tiny_job())["id"])
    service.wait_state(service.submit(FAILING)["id"])
    service.submit({**tiny_job(), "device": "cuda:5"})  # stays queued
    with service.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'trainyard_jobs{kind="train",state="succeeded"} 1.0' in text
    assert 'trainyard_jobs{kind="train",state="failed"} 1.0' in text
    assert 'trainyard_queue_depth{device="cuda:5",reason="no_device_worker"} 1.0' in text
    assert 'trainyard_job_duration_seconds_count{kind="train",state="succeeded"} 1.0' in text
    assert 'trainyard_job_duration_seconds_count{kind="train",state="failed"} 1.0' in text
    assert f'trainyard_workers_alive{{device="cpu",host="{socket.gethostname()}"}} 1.0' in text
    for name in ("trainyard_device_memory_used_bytes", "trainyard_torch_memory_allocated_bytes",
                 "trainyard_job_samples_per_second"):
        assert f"# TYPE {name} gauge" in text


@on_sqlite_only
def test_catalog(service):
    with service.client() as c:
        cat = c.get("/catalog").json()
    names = [a["name"] for a in cat["architectures"]]
    assert names[:3] == ["mlp", "cnn", "cifar_net"] and "resnet18" in names
    assert {d["name"] for d in cat["datasets"]} >= {"iris", "digits", "mnist", "fashion_mnist", "cifar10", "fake"}
    assert cat["schemas"]["train"]["properties"]["train"]


@on_sqlite_only
def test_cli_follow_and_watch(service, tmp_path):
    service.start_worker("cpu")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT,
                              env={**service.env, "COLUMNS": "160"}, capture_output=True, text=True, timeout=120)

    good = tmp_path / "good.json"
    good.write_text(json.dumps(tiny_job(epochs=5)))
    r = cli("submit", str(good), "--follow")
    assert r.returncode == 0, r.stderr
    assert "5/5" in r.stderr and "succeeded" in r.stderr and "val_acc" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(FAILING))
    r = cli("submit", str(bad), "--follow")
    assert r.returncode == 1 and "failed" in r.stderr and "JobError" in r.stderr
    job_id = service.submit(tiny_job(epochs=2))["id"]
    r = cli("watch", str(job_id))
    assert r.returncode == 0 and "2/2" in r.stderr
