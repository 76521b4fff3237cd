"""Jobs that wait for jobs (app/fleet/dependencies.py): `after`, a model_job or init_from still queued or running, a
batch's "$N"; never claimed before those succeed, failed with class dependency when one ends otherwise (failed,
cancelled, deleted), checked at submit (422s naming the field); and a train -> evaluate -> predict pipeline
submitted at once over HTTP with a real worker, on SQLite and on PostgreSQL."""
import json
import time

import pytest
from pydantic import TypeAdapter
from sqlalchemy import delete, select

from tests.helpers.backends import on_both_backends, on_postgres_only, on_sqlite_only
from tests.helpers.jobs import tiny_job
from tests.helpers.service import ROOT
from trainyard import Client
from trainyard.app.core.errors import Invalid
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import SweepState
from trainyard.app.db import job_deps, jobs, read, write
from trainyard.app.duties.dependents import fail_dependents
from trainyard.app.fleet import waiting
from trainyard.app.jobs import admission, queue, submit
from trainyard.app.records import job_reads
from trainyard.app.spec import JobBatch, SweepSpec, parse_spec
from trainyard.app.sweeps import sweep_store

service_backend = on_both_backends()
EVALUATE = {"kind": "predict", "data": {"dataset": "iris", "split": "val"}, "device": "cpu"}
# Diverges within a few epochs: the job fails with class job (tests/jobs/test_reliability.py).
DIVERGING = {**tiny_job(), "model": {"arch": "mlp", "hidden": [256, 256, 256]},
             "train": {"epochs": 20, "batch_size": 8, "optimizer": "sgd", "lr": 10.0, "momentum": 0.99}}


def put(engine, body=None, **over):
    job, _ = submit.enqueue(engine, parse_spec({**(body or tiny_job()), **over}))
    return job


def claim(engine):
    return queue.claim(engine, "w", "cpu", 30)


def finish(engine, job):
    assert queue.succeed(engine, job.id, job.claim, {}, None)


@pytest.fixture
def settings(engine, tmp_path):
    return Settings(data_dir=tmp_path / "data")


def test_a_job_is_claimed_only_once_what_it_waits_for_has_succeeded(engine, settings):
    a, b = put(engine), put(engine)
    c = put(engine, after=[a.id, b.id], priority=10)  # first in line, were it not waiting
    took = claim(engine)
    assert took.id == a.id
    why = waiting.of_jobs(engine, settings, [job_reads.get_job(engine, c.id)])[c.id]
    assert f"{a.id} (running)" in why and f"{b.id} (queued)" in why
    finish(engine, took)
    took = claim(engine)
    assert took.id == b.id  # c still waits on b
    assert claim(engine) is None
    assert f"{b.id} (running)" in waiting.of_jobs(engine, settings, [job_reads.get_job(engine, c.id)])[c.id]
    finish(engine, took)
    assert claim(engine).id == c.id


def test_a_model_job_still_queued_is_waited_for(engine, settings):
    train = put(engine)
    spec = parse_spec({**EVALUATE, "model_job": train.id})
    admitted = admission.admit(engine, settings, spec, waits=True)
    evaluate, _ = submit.enqueue(engine, spec, None, admitted.parameters, admitted.needs)
    fine_tune = put(engine, init_from=train.id)
    with read(engine) as conn:
        deps = conn.execute(select(job_deps.c.job_id, job_deps.c.after_id).order_by(job_deps.c.job_id)).all()
    assert [tuple(d) for d in deps] == [(evaluate.id, train.id), (fine_tune.id, train.id)]
    took = claim(engine)
    assert took.id == train.id and claim(engine) is None
    finish(engine, took)
    assert {claim(engine).id, claim(engine).id} == {evaluate.id, fine_tune.id}


def test_a_dependency_that_fails_is_cancelled_or_deleted_fails_its_dependents(engine):
    a = put(engine)
    b = put(engine, after=[a.id])
    c = put(engine, after=[b.id])      # a chain: fails in the same pass
    d = put(engine, {"kind": "predict", "model_job": a.id, "inputs": [[1, 2, 3, 4]], "device": "cpu"})
    other = put(engine)
    e = put(engine, after=[other.id])
    assert fail_dependents(engine) == []  # nothing has ended yet
    took = claim(engine)
    assert took.id == a.id
    assert queue.fail(engine, a.id, took.claim, {"class": "job", "type": "JobError", "message": "nan"}) == "failed"
    assert sorted(fail_dependents(engine)) == sorted([b.id, c.id, d.id])
    for job, named in ((b, a), (c, b), (d, a)):
        failed = job_reads.get_job(engine, job.id)
        assert failed.state == "failed" and failed.error["class"] == "dependency", failed.error
        assert f"job {named.id}," in failed.error["message"] and "failed" in failed.error["message"]
        assert failed.attempt == 0 and len(failed.errors) == 1  # never ran, not retried
    queue.cancel(engine, other.id)
    assert fail_dependents(engine) == [e.id]
    assert "cancelled" in job_reads.get_job(engine, e.id).error["message"]

    gone = put(engine)
    f = put(engine, after=[gone.id])
    with write(engine) as conn:  # as a deletion leaves it: the row vanishes, the dependency stays
        conn.execute(delete(jobs).where(jobs.c.id == gone.id))
    assert fail_dependents(engine) == [f.id]
    assert f"job {gone.id}, which this job waits for, was deleted" in job_reads.get_job(engine, f.id).error["message"]


def test_a_retried_dependent_waits_again(engine):
    a = put(engine)
    b = put(engine, after=[a.id])
    queue.cancel(engine, a.id)
    assert fail_dependents(engine) == [b.id]
    queue.retry(engine, a.id)
    queue.retry(engine, b.id)  # its dependency is queued again: it waits, and is not failed again
    assert fail_dependents(engine) == []
    took = claim(engine)
    assert took.id == a.id and claim(engine) is None
    finish(engine, took)
    assert claim(engine).id == b.id


def refused(engine, settings, body, loc, words, waits=True, batch=None):
    with pytest.raises(Invalid) as e:
        admission.admit(engine, settings, parse_spec(body), waits=waits, batch=batch)
    assert e.value.loc == loc and all(w in str(e.value) for w in words), (e.value.loc, str(e.value))


def test_submit_checks_what_a_job_waits_for(engine, settings):
    a = put(engine)
    nxt = a.id + 1  # the id this job would get: naming itself is naming a job that does not exist yet
    refused(engine, settings, tiny_job() | {"after": [a.id, nxt]}, ("after", 1), [f"job {nxt} does not exist"])
    refused(engine, settings, tiny_job() | {"after": ["$0"]}, ("after", 0), ["POST /jobs/batch"])
    refused(engine, settings, {**EVALUATE, "model_job": "$0"}, ("model_job",), ["POST /jobs/batch"])
    cancelled = put(engine)
    queue.cancel(engine, cancelled.id)
    refused(engine, settings, tiny_job() | {"after": [cancelled.id]}, ("after", 0), ["cancelled", "will not succeed"])
    refused(engine, settings, {**EVALUATE, "model_job": cancelled.id}, ("model_job",), ["cancelled"])
    predicting = put(engine, {**EVALUATE, "model_job": a.id})
    refused(engine, settings, {**EVALUATE, "model_job": predicting.id}, ("model_job",), ["predict job"])
    # A sweep's base job is admitted without waiting: its trials are made later, outside any submit.
    refused(engine, settings, tiny_job() | {"init_from": a.id}, ("init_from",), ["queued", "must have succeeded"],
            waits=False)
    with pytest.raises(ValueError, match="after"):
        SweepSpec.model_validate({"job": tiny_job() | {"after": [a.id]}, "parameters": {
            "train.lr": {"type": "float", "low": 0.001, "high": 0.1}}})
    # Within a batch: only earlier jobs, and the model a "$N" names is that job's.
    first = parse_spec(tiny_job())
    refused(engine, settings, tiny_job() | {"after": ["$1"]}, ("after", 0), ["this job"], batch=[first])
    refused(engine, settings, tiny_job() | {"after": ["$2"]}, ("after", 0), ["later job"], batch=[first])
    refused(engine, settings, tiny_job() | {"model": {"arch": "cnn"}, "init_from": "$0"}, ("init_from",),
            ["mlp", "cnn"], batch=[first])
    with pytest.raises(Invalid) as e:
        admission.admit_batch(engine, settings, [first, parse_spec({**EVALUATE, "model_job": "$3"})])
    assert e.value.loc == (1, "model_job")


def test_a_batch_is_inserted_in_order_with_its_references_resolved(engine, settings):
    specs = [parse_spec(tiny_job()), parse_spec({**EVALUATE, "model_job": "$0"}),
             parse_spec({**EVALUATE, "model_job": "$0", "after": ["$1"]})]
    admitted = admission.admit_batch(engine, settings, specs)
    made = submit.enqueue_many(engine, specs, [(a.parameters, a.needs) for a in admitted])
    train, evaluate, last = made
    assert train.id < evaluate.id < last.id
    assert evaluate.spec["model_job"] == train.id and last.spec["after"] == [evaluate.id]
    with read(engine) as conn:
        deps = {tuple(r) for r in conn.execute(select(job_deps.c.job_id, job_deps.c.after_id))}
    assert deps == {(evaluate.id, train.id), (last.id, train.id), (last.id, evaluate.id)}


def sweep_with_trials(engine, settings, losses: list[float | None]):
    """A sweep (held by driver "d") with one trial per loss, each run to success with that val_loss (None: failed)."""
    spec = SweepSpec.model_validate({"job": tiny_job(), "method": "random", "max_trials": len(losses),
                                     "parameters": {"train.lr": {"type": "float", "low": 1e-4, "high": 0.1}}})
    sweep = sweep_store.create(engine, settings, spec)
    assert sweep_store.take(engine, sweep.id, "d", 60)
    trials = []
    for i, loss in enumerate(losses):
        trial = sweep_store.enqueue_trial(engine, sweep.id, "d", i, {"train.lr": 0.01}, parse_spec(tiny_job()),
                                          admission.Admitted())
        took = claim(engine)
        assert trial is not None and took.id == trial.id
        if loss is None:
            queue.fail(engine, took.id, took.claim, {"class": "job", "type": "JobError", "message": "nan"})
        else:
            assert queue.succeed(engine, took.id, took.claim, {"val_loss": loss}, None)
        trials.append(trial)
    return sweep, trials


def test_a_sweeps_best_trial_is_waited_for_then_named(engine, settings):
    sweep, trials = sweep_with_trials(engine, settings, [0.5, 0.2, 0.9])
    ref = f"sweep:{sweep.id}:best"
    spec = parse_spec({**EVALUATE, "model_job": ref})
    admission.admit(engine, settings, spec, waits=True)  # running: nothing to check yet
    refused(engine, settings, tiny_job() | {"init_from": ref}, ("init_from",), ["is running"], waits=False)
    evaluate, _ = submit.enqueue(engine, spec)
    fine_tune = put(engine, init_from=ref)
    assert fail_dependents(engine) == [] and claim(engine) is None  # the sweep still runs
    shown = waiting.of_jobs(engine, settings, [job_reads.get_job(engine, evaluate.id)])[evaluate.id]
    assert f"sweep {sweep.id}'s best trial (running)" in shown
    assert sweep_store.finish(engine, sweep.id, "d", SweepState.SUCCEEDED)
    assert fail_dependents(engine) == []
    for job in (evaluate, fine_tune):  # the best trial (lowest val_loss) takes the reference's place
        settled = job_reads.get_job(engine, job.id)
        assert settled.spec["model_job" if job is evaluate else "init_from"] == trials[1].id
    assert {claim(engine).id, claim(engine).id} == {evaluate.id, fine_tune.id}
    # Once the sweep has ended, a submit checks its best trial as any model job.
    refused(engine, settings, tiny_job() | {"model": {"arch": "cnn"}, "init_from": ref}, ("init_from",), ["mlp"])


def test_a_sweep_that_ends_with_no_best_trial_fails_the_jobs_waiting_on_it(engine, settings):
    sweep, _ = sweep_with_trials(engine, settings, [None])
    ref = f"sweep:{sweep.id}:best"
    evaluate = put(engine, {**EVALUATE, "model_job": ref})
    assert sweep_store.finish(engine, sweep.id, "d", SweepState.FAILED, "every trial failed")
    assert fail_dependents(engine) == [evaluate.id]
    failed = job_reads.get_job(engine, evaluate.id)
    assert failed.error["class"] == "dependency"
    assert f"sweep {sweep.id}, whose best trial this job waits for, ended failed with no best trial" \
        in failed.error["message"]
    refused(engine, settings, {**EVALUATE, "model_job": ref}, ("model_job",), ["no best trial"])
    refused(engine, settings, {**EVALUATE, "model_job": "sweep:999:best"}, ("model_job",), ["does not exist"])


# ---- over HTTP, with a real worker --------------------------------------------------------------

def pipeline(first: dict) -> list[dict]:
    """Train, evaluate on the held-out split, then predict rows (once the evaluation has succeeded)."""
    return [first, {**EVALUATE, "model_job": "$0"},
            {"kind": "predict", "model_job": "$0", "inputs": [[5.1, 3.5, 1.4, 0.2]], "device": "cpu",
             "after": ["$1"]}]


def submit_batch(service, body) -> list[dict]:
    with service.client() as c:
        r = c.post("/jobs/batch", json=body)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.mark.slow
@on_sqlite_only
def test_a_pipeline_submitted_at_once_runs_in_order(service):
    made = submit_batch(service, pipeline(tiny_job(epochs=3)))
    assert [j["state"] for j in made] == ["queued"] * 3
    train, evaluate, predict = (j["id"] for j in made)
    assert made[1]["spec"]["model_job"] == train and made[2]["spec"]["after"] == [evaluate]
    shown = service.job(predict)
    assert shown["state"] == "queued" and f"{train} (queued)" in shown["waiting_for"]
    service.start_worker("cpu")
    done = [service.wait_state(i, timeout=120) for i in (train, evaluate, predict)]
    assert [j["state"] for j in done] == ["succeeded"] * 3, [j["error"] for j in done]
    assert done[0]["finished_at"] <= done[1]["started_at"] and done[1]["finished_at"] <= done[2]["started_at"]
    assert "accuracy" in done[1]["result"]
    with service.client() as c:
        rows = c.get(f"/jobs/{predict}/result").json()
    assert rows  # the model the pipeline trained answered


def test_the_docs_pipeline_is_a_batch_the_service_admits(engine, settings):
    section = (ROOT / "docs/training.md").read_text().split("\n## Pipelines\n", 1)[1].split("\n## ", 1)[0]
    body = json.loads(section.split("/jobs/batch -H 'Content-Type: application/json' -d '", 1)[1].split("'\n", 1)[0])
    specs = TypeAdapter(JobBatch).validate_python(body)
    assert [s.kind for s in specs] == ["train", "predict", "predict"] and specs[2].after == ["$1"]
    assert len(admission.admit_batch(engine, settings, specs)) == 3
    assert "c.jobs.submit_many(" in section


@pytest.mark.slow
@on_sqlite_only
def test_a_pipeline_whose_first_job_fails_ends_cleanly(service):
    service.start_worker("cpu")
    with Client(service.url) as c:  # the client's verb for POST /jobs/batch
        train, evaluate, predict = (j.id for j in c.jobs.submit_many(pipeline(DIVERGING)))
    assert service.wait_state(train, timeout=90)["error"]["class"] == "job"
    deadline = time.monotonic() + 10
    for job_id, named in ((evaluate, train), (predict, train)):
        done = service.wait_state(job_id, timeout=max(1.0, deadline - time.monotonic()))
        assert done["state"] == "failed" and done["error"]["class"] == "dependency", done["error"]
        assert f"job {named}," in done["error"]["message"] and done["started_at"] is None
    with service.client() as c:
        r = c.post("/jobs/batch", json=[tiny_job(), {**EVALUATE, "model_job": "$1"}])
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", 1, "model_job"], r.text
        assert "this job" in r.json()["detail"][0]["msg"]
        assert c.get("/jobs", params={"limit": 500}).json()["count"] == 3  # all or none
        r = c.post("/jobs", json={**tiny_job(), "after": [predict + 100]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "after", 0]


@pytest.mark.slow
@on_postgres_only
def test_a_job_waits_for_a_sweeps_best_trial_over_http(service):
    with service.client() as c:
        r = c.post("/sweeps", json={"job": tiny_job(epochs=2), "method": "grid", "max_concurrent": 1,
                                    "parameters": {"train.lr": {"type": "choice", "values": [0.001, 0.05]}}})
        assert r.status_code == 201, r.text
        sweep = r.json()["id"]
        evaluate = c.post("/jobs", json={**EVALUATE, "model_job": f"sweep:{sweep}:best"}).json()
        assert evaluate["state"] == "queued"
        assert f"sweep {sweep}'s best trial (running)" in c.get(f"/jobs/{evaluate['id']}").json()["waiting_for"]
        service.start_worker("cpu")
        done = service.wait_state(evaluate["id"], timeout=120)
        ended = c.get(f"/sweeps/{sweep}").json()
        assert ended["state"] == "succeeded" and done["state"] == "succeeded", done["error"]
        assert done["spec"]["model_job"] == ended["best"]["job_id"]  # the best trial took the reference's place
        assert done["started_at"] >= ended["finished_at"]
