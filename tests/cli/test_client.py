"""The Python client against the real server and a CPU worker: each resource's verbs (client.jobs, .sweeps,
.datasets, .workers), the typed records they answer, and the old flat names, which warn and still work."""
import inspect
import json
import re
import warnings

import pytest

from tests.helpers.data import iris_csv
from tests.helpers.jobs import tiny_job
from trainyard import APIError, Client, Dataset, Event, Job, Page, Sweep, Worker
from trainyard.app.client import DEPRECATED, TERMINAL
from trainyard.app.client.models import LogChunk

WAITING = {**tiny_job(), "device": "cuda"}  # no worker serves CUDA here: it stays queued until cancelled
GRID = {"job": tiny_job(epochs=2), "method": "grid", "max_concurrent": 1,
        "parameters": {"train.lr": {"type": "choice", "values": [0.01, 0.05]}}}


@pytest.fixture
def client(live):
    with Client(live.url) as c:
        yield c


@pytest.mark.slow
def test_jobs_submit_wait_get_list_and_read_what_a_job_made(client, tmp_path):
    job = client.jobs.submit(tiny_job(epochs=3), idempotency_key="client-test-1")
    assert isinstance(job, Job) and job.state == "queued" and job["state"] == "queued"
    assert client.jobs.submit(tiny_job(epochs=3), idempotency_key="client-test-1").id == job.id
    done = client.jobs.wait(job.id, timeout=120)
    assert isinstance(done, Job) and done.state == "succeeded" and done.progress == {"epoch": 3, "epochs": 3}
    assert client.jobs.get(job.id) == done and json.loads(json.dumps(done)) == done  # still the JSON, as a dict
    page = client.jobs.list(state="succeeded", limit=1)
    assert isinstance(page, Page) and page.count >= 1 and [j.id for j in page.data] == [job.id]
    assert all(isinstance(j, Job) for j in page.data) and page["data"][0]["id"] == job.id
    assert [m["epoch"] for m in client.jobs.metrics(job.id)] == [1, 2, 3]
    assert "val_accuracy" in client.jobs.result(job.id)
    chunk = client.jobs.read_log(job.id)
    assert isinstance(chunk, LogChunk) and chunk.start == 0 and chunk.size == len(chunk.data) > 0
    assert client.jobs.logs(job.id) == chunk.data.decode()
    events = list(client.jobs.events(job.id))
    assert all(isinstance(e, Event) for e in events) and events[-1].event == "end"
    assert events[-1].data == {"id": job.id, "state": "succeeded"}
    out = client.jobs.download(job.id, tmp_path / "m.safetensors")
    assert out.stat().st_size > 0 and not (tmp_path / "m.safetensors.part").exists()


@pytest.mark.slow
def test_jobs_cancel_and_retry(client):
    job = client.jobs.submit(WAITING)
    cancelled = client.jobs.cancel(job.id)
    assert isinstance(cancelled, Job) and cancelled.state == "cancelled"
    assert client.jobs.wait(job.id, timeout=10).state == "cancelled"
    again = client.jobs.retry(job.id)
    assert isinstance(again, Job) and again.state == "queued"
    with pytest.raises(TimeoutError, match=f"job {job.id} is still queued"):
        client.jobs.wait(job.id, timeout=0.3)
    assert client.jobs.cancel(job.id).state == "cancelled"
    with pytest.raises(APIError) as missing:
        client.jobs.get(999_999)
    assert missing.value.status_code == 404


@pytest.mark.slow
def test_sweeps_submit_wait_get_list_events_curves_and_cancel(client):
    sweep = client.sweeps.submit({**GRID, "name": "client-grid"})
    assert isinstance(sweep, Sweep) and sweep.state == "running" and sweep.name == "client-grid"
    done = client.sweeps.wait(sweep.id, timeout=120)
    assert isinstance(done, Sweep) and done.state == "succeeded" and done.counts["succeeded"] == 2
    got = client.sweeps.get(sweep.id)
    assert got.trials is not None and len(got.trials) == 2 and got.best is not None
    assert [t["trial"] for t in client.sweeps.trials(sweep.id)] == [0, 1]
    assert sweep.id in [s.id for s in client.sweeps.list(state="succeeded").data]
    events = list(client.sweeps.events(sweep.id))
    assert events[-1].event == "end" and events[-1].data["state"] == "succeeded"
    curves = client.sweeps.curves(sweep.id)
    assert sorted(len(t["points"]) for t in curves["trials"]) == [2, 2]
    waiting = client.sweeps.submit({**GRID, "job": WAITING})
    assert client.sweeps.cancel(waiting.id).state == "cancelled"
    assert client.sweeps.wait(waiting.id, timeout=10).state == "cancelled"


@pytest.mark.slow
def test_datasets_upload_get_list_delete(client, tmp_path):
    csv = tmp_path / "flowers.csv"
    csv.write_bytes(iris_csv())
    made = client.datasets.upload(csv, label_column="species")
    assert isinstance(made, Dataset) and made.dataset == f"upload:{made.id}" and made.samples == 150
    assert client.datasets.get(made.id) == made
    page = client.datasets.list()
    assert isinstance(page, Page) and made.id in [d.id for d in page.data] and page.count == len(page.data)
    assert client.datasets.delete(made.id) is None
    with pytest.raises(APIError) as gone:
        client.datasets.get(made.id)
    assert gone.value.status_code == 404


@pytest.mark.slow
def test_workers_list_drain_undrain(client):
    page = client.workers.list()
    assert isinstance(page, Page) and page.count == 1
    [worker] = page.data
    assert isinstance(worker, Worker) and worker.device == "cpu" and worker.draining is False
    assert client.workers.drain(worker.id).draining is True
    assert client.workers.undrain(worker.id).draining is False
    assert "cuda_available" in client.devices() and "schemas" in client.catalog()


@pytest.mark.slow
def test_every_old_name_warns_naming_the_new_call_and_still_works(client, live, tmp_path):
    job = client.jobs.wait(client.jobs.submit(tiny_job()).id, timeout=120)
    sweep = client.sweeps.wait(client.sweeps.submit(GRID).id, timeout=120)
    worker = client.workers.list().data[0]
    csv = tmp_path / "iris.csv"
    csv.write_bytes(iris_csv())
    waiting = client.jobs.submit(WAITING).id
    waiting_sweep = client.sweeps.submit({**GRID, "job": WAITING}).id
    calls = {  # old name -> its arguments, and what the answer must hold
        "submit": ((tiny_job(),), lambda r: r["state"] == "queued"),
        "get": ((job.id,), lambda r: r == job),
        "list": ((), lambda r: r["count"] >= 2),
        "wait": ((job.id,), lambda r: r["state"] == "succeeded"),
        "events": ((job.id,), lambda r: list(r)[-1]["event"] == "end"),
        "metrics": ((job.id,), lambda r: len(r) == 2),
        "logs": ((job.id,), lambda r: isinstance(r, str) and r),
        "read_log": ((job.id,), lambda r: r[1] == 0 and r[2] == len(r[0])),
        "result": ((job.id,), lambda r: "val_accuracy" in r),
        "download": ((job.id, tmp_path / "m.safetensors"), lambda r: r.stat().st_size > 0),
        "cancel": ((waiting,), lambda r: r["state"] == "cancelled"),
        "retry": ((waiting,), lambda r: r["state"] == "queued"),
        "submit_sweep": (({**GRID, "job": WAITING},), lambda r: r["state"] == "running"),
        "sweep": ((sweep.id,), lambda r: r == sweep),
        "sweeps": ((), lambda r: sweep.id in [s["id"] for s in r["data"]]),
        "sweep_trials": ((sweep.id,), lambda r: len(r) == 2),
        "sweep_curves": ((sweep.id,), lambda r: len(r["trials"]) == 2),
        "sweep_events": ((sweep.id,), lambda r: list(r)[-1]["event"] == "end"),
        "wait_sweep": ((sweep.id,), lambda r: r["state"] == "succeeded"),
        "cancel_sweep": ((waiting_sweep,), lambda r: r["state"] == "cancelled"),
        "upload": ((csv, "species"), lambda r: r["samples"] == 150),
        "datasets": ((), lambda r: r["count"] == len(r["data"]) >= 1),
        "workers": ((), lambda r: isinstance(r, list) and r[0]["id"] == worker.id),
        "drain": ((worker.id,), lambda r: r["draining"] is True),
        "undrain": ((worker.id,), lambda r: r["draining"] is False),
    }
    assert set(calls) == set(DEPRECATED)
    made = []
    for old, (args, holds) in calls.items():
        with pytest.warns(DeprecationWarning, match=rf"Client\.{old}\(\) is deprecated: use "
                                                    rf"client\.{DEPRECATED[old].replace('.', r'[.]')}\(\)"):
            answer = getattr(client, old)(*args)
            assert holds(answer), (old, answer)
        if old in ("submit", "submit_sweep"):
            made.append((client.jobs if old == "submit" else client.sweeps, answer["id"]))
    client.jobs.cancel(waiting)
    for resource, made_id in made:  # leave nothing running or queued for the next test
        if resource.get(made_id)["state"] not in TERMINAL:
            try:
                resource.cancel(made_id)
            except APIError as e:  # it ended between the read and the cancel
                assert e.status_code == 409, e
    with pytest.warns(DeprecationWarning, match=r"use client\.jobs\.get\(\)"):
        assert Client.get(client, job.id) == job  # called as an unbound method, as old code may
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.jobs.get(job.id)  # the new names do not warn


def test_records_are_the_json_with_typed_attributes():
    job = Job({"id": 3, "state": "running", "progress": {"epoch": 1, "epochs": 4}})
    assert job.id == 3 and job["state"] == job.state == "running" and job.result is None
    assert job == {"id": 3, "state": "running", "progress": {"epoch": 1, "epochs": 4}} and repr(job).startswith("Job(")
    page = Page.of(Sweep, {"data": [{"id": 1}, {"id": 2}], "count": 9, "limit": 2, "offset": 0})
    assert [s.id for s in page.data] == [1, 2] and page.count == 9 and page.next_offset is None
    assert json.loads(json.dumps(page)) == {"data": [{"id": 1}, {"id": 2}], "count": 9, "limit": 2, "offset": 0}
    assert Job.state.key == "state"  # the class's attribute is the field itself


def test_the_client_says_every_verb_and_what_it_takes():
    """help(Client) lists each namespace's verbs with their parameters, as the code has them; a list's
    docstring names each filter it takes."""
    doc = " ".join((Client.__doc__ or "").split())
    with Client("http://127.0.0.1:9") as c:  # nothing is requested
        for ns in ("jobs", "sweeps", "datasets", "workers"):
            section = re.search(rf"client\.{ns}: (.*?)(?= - client\.| and the service|$)", doc)
            assert section, ns
            resource = getattr(c, ns)
            for verb in (v for v in dir(resource) if not v.startswith("_") and inspect.ismethod(getattr(resource, v))):
                params = inspect.signature(getattr(resource, verb)).parameters.values()
                said = ", ".join(p.name if p.default is p.empty else f"{p.name}=" for p in params)
                assert f"{verb}({said})" in section.group(1), (ns, verb, said)
            if hasattr(resource, "list"):
                listed = inspect.getdoc(resource.list) or ""
                for p in inspect.signature(resource.list).parameters:
                    assert f"`{p}`" in listed or f"{p}=" in listed, (ns, p)
    for call in ("devices()", "catalog()", "request(method, path, ...)"):
        assert call in doc
