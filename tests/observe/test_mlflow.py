"""Every tracked job and sweep as an MLflow run (app/tracking/), against a real `mlflow server` (SQLite backend, served
artifacts) read back with MLflow's own client, field by field: a train job (its parameters, a point per epoch per
metric as GET /jobs/{id}/metrics lists them, its tags, status, model files and registered version), a `run` job's own
reports, an evaluation; a sweep as a parent run whose trials are child runs, a pruned trial KILLED and tagged, its
retry a new run that names the first; a job SIGKILLed and resumed as one run with each epoch once; the tracker
stopped during a job, which succeeds regardless, and its run complete once the tracker is back."""
import os
import signal
import time

import pytest

from tests.helpers.backends import fresh_database
from tests.helpers.browser import ARGS, CHROMIUM
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.mlflow import mlflow_server
from tests.helpers.service import ROOT, metrics, probe_plugin, run_job, serving
from tests.helpers.sweeps import start_sweep, wait_sweep

pytestmark = pytest.mark.slow  # a real MLflow server, the real trainyard server and workers, training

PASSWORD = "tracker-password-never-shown"
RUN_PLUGIN = '''
def reports(ctx, config):
    for epoch in range(1, config["epochs"] + 1):
        ctx.report(epoch, loss=1.0 / epoch, accuracy=epoch / 10)
    return {"accuracy": 0.9, "note": "done"}
'''
NOT_METRICS = {"epoch", "epochs", "attempt", "at", "recorded_at"}


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def tracked_env(tracker) -> dict[str, str]:
    return {"TRAINYARD_MLFLOW_TRACKING_URI": tracker.uri, "TRAINYARD_MLFLOW_USERNAME": "trainyard",
            "TRAINYARD_MLFLOW_PASSWORD": PASSWORD, "TRAINYARD_MLFLOW_RETRY_MAX_S": "1"}


@pytest.fixture(scope="module")
def live(tracker, tmp_path_factory):
    plugin = probe_plugin(tmp_path_factory.mktemp("plugin"), "trainyard_mlflow_probe", RUN_PLUGIN, ("reports",))
    with serving(tmp_path_factory.mktemp("tracked") / "data", workers=2, env=tracked_env(tracker),
                 worker_env={"PYTHONPATH": f"{ROOT}:{plugin}"}) as svc:
        yield svc


def tracked_run(svc, job_id: int, timeout: float = 60) -> dict:
    """The job's record's tracking.mlflow once the tracker holds all its records."""
    svc.wait_until(lambda: ((svc.job(job_id).get("tracking") or {}).get("mlflow") or {}).get("complete"), timeout,
                   f"job {job_id}'s MLflow run to be complete")
    return svc.job(job_id)["tracking"]["mlflow"]


def same_as_metrics(client, run_id: str, records: list[dict]) -> None:
    """Every number of every epoch record is the metric of its name at step = epoch, once."""
    names = {k for r in records for k, v in r.items() if isinstance(v, int | float) and k not in NOT_METRICS}
    assert names
    for name in names:
        want = {r["epoch"]: float(r[name]) for r in records if isinstance(r.get(name), int | float)}
        history = client.get_metric_history(run_id, name)
        assert sorted(m.step for m in history) == sorted(want), name  # each epoch once: no gap, no repeat
        assert all(abs(m.value - want[m.step]) <= 1e-9 * max(1.0, abs(want[m.step])) for m in history), name


def test_train_run_and_evaluation_jobs_are_mlflow_runs_field_by_field(live, tracker):
    client = tracker.client()
    train = live.submit({**tiny_job(epochs=4, lr=0.02), "name": "iris-tracked",
                         "tracking": {"experiment": "iris-experiment", "register_model": "iris-model",
                                      "git_commit": "0123abcd"}})
    run = live.submit(run_job("reports", epochs=3))
    evaluation = live.submit({"kind": "predict", "model_job": train["id"], "device": "cpu",
                              "data": {"dataset": "iris", "split": "val"}})
    untracked = live.submit({**tiny_job(epochs=1), "tracking": {"mlflow": False}})
    rows = live.submit({"kind": "predict", "model_job": train["id"], "device": "cpu", "inputs": [[5.1, 3.5, 1.4, 0.2]]})
    done = {j["id"]: live.wait_state(j["id"]) for j in (train, run, evaluation, untracked, rows)}
    assert all(d["state"] == "succeeded" for d in done.values()), done

    # The train job: its experiment, parameters, a point per epoch per metric, tags, status, model and version.
    t = tracked_run(live, train["id"])
    got = client.get_run(t["run_id"])
    assert client.get_experiment(got.info.experiment_id).name == "iris-experiment"
    assert t["url"] == f"{tracker.uri}/#/experiments/{got.info.experiment_id}/runs/{t['run_id']}"
    assert t["error"] is None and t["status"] == "FINISHED" and t["earlier_runs"] == []
    assert got.data.params["train.lr"] == "0.02" and got.data.params["model.arch"] == "mlp"
    assert got.data.params["train.epochs"] == "4" and got.data.params["data.dataset"] == "iris"
    assert got.data.params["model.hidden"] == "[8]"
    same_as_metrics(client, t["run_id"], metrics(live, train["id"]))
    job = done[train["id"]]
    assert got.data.metrics["final/val_accuracy"] == pytest.approx(job["result"]["val_accuracy"])
    tags = got.data.tags
    assert tags["mlflow.runName"] == "iris-tracked" and tags["trainyard.job_id"] == str(train["id"])
    assert tags["trainyard.url"] == f"{live.url}/#/jobs/{train['id']}" and tags["trainyard.kind"] == "train"
    assert tags["mlflow.source.git.commit"] == "0123abcd" and tags["trainyard.project"] == "default"
    assert tags["trainyard.worker"] == job["worker_id"] and tags["trainyard.device"] == "cpu"
    assert got.info.status == "FINISHED"
    assert got.info.start_time <= got.info.end_time
    assert {a.path for a in client.list_artifacts(t["run_id"], "model")} >= {
        "model/model.safetensors", "model/meta.json", "model/model.pt"}
    [version] = client.search_model_versions("name='iris-model'")
    assert version.run_id == t["run_id"] and t["model_version"] == version.version == "1"

    # The run job: its own reports and the numbers it returned; the service's default experiment.
    r = tracked_run(live, run["id"])
    got = client.get_run(r["run_id"])
    assert client.get_experiment(got.info.experiment_id).name == "trainyard-default"
    same_as_metrics(client, r["run_id"], metrics(live, run["id"]))
    assert [m.step for m in client.get_metric_history(r["run_id"], "loss")] == [1, 2, 3]
    assert got.data.metrics["final/accuracy"] == 0.9 and "final/note" not in got.data.metrics
    assert got.data.params["entrypoint"] == "reports" and got.data.params["config.epochs"] == "3"
    assert got.info.status == "FINISHED"

    # The evaluation: its accuracy and loss; no model of its own.
    e = tracked_run(live, evaluation["id"])
    got = client.get_run(e["run_id"])
    assert got.data.tags["trainyard.kind"] == "evaluate" and got.data.params["model_job"] == str(train["id"])
    assert got.data.metrics["final/accuracy"] == pytest.approx(done[evaluation["id"]]["result"]["accuracy"])
    assert client.list_artifacts(e["run_id"]) == []

    # Opted out, or a predict job on inputs: no run. The tracker's password is in none of what the service shows.
    assert live.job(untracked["id"])["tracking"] is None and live.job(rows["id"])["tracking"] is None
    assert len(client.search_runs([got.info.experiment_id, client.get_run(t["run_id"]).info.experiment_id])) == 3
    with live.client() as c:
        for job_id in done:
            assert PASSWORD not in c.get(f"/jobs/{job_id}").text and PASSWORD not in c.get(f"/jobs/{job_id}/logs").text
        assert PASSWORD not in c.get("/metrics").text
    assert PASSWORD not in live.output()

    # The dashboard's job page links to the run.
    from playwright.sync_api import expect, sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{live.url}/#/jobs/{train['id']}")
            link = page.get_by_test_id("job-mlflow")
            expect(link).to_have_attribute("href", t["url"])
            expect(page.get_by_test_id("job-facts")).to_contain_text("model version 1 · complete")
            page.goto(f"{live.url}/#/jobs/{untracked['id']}")
            expect(page.get_by_test_id("job-state")).to_have_text("succeeded")
            expect(page.get_by_test_id("job-mlflow")).to_have_count(0)
        finally:
            browser.close()


def test_a_sweep_is_a_parent_run_its_pruned_trial_killed_and_its_retry_a_new_linked_run(live, tracker):
    client = tracker.client()
    epochs = 300
    made = start_sweep(live, job=tiny_job(epochs, batch_size=8), method="grid", max_concurrent=1, seed=1,
                       name="lr-grid", parameters={"train.lr": {"type": "choice", "values": [0.05, 1e-6]}},
                       pruner={"type": "median", "startup_trials": 1, "warmup_epochs": 5})
    done = wait_sweep(live, made["id"], timeout=300)
    assert done["counts"]["succeeded"] == 1 and done["counts"]["pruned"] == 1, done
    good = next(t for t in done["trials"] if t["state"] == "succeeded")
    bad = next(t for t in done["trials"] if t["state"] == "pruned")
    runs = {t["job_id"]: tracked_run(live, t["job_id"]) for t in (good, bad)}

    def parent_sent():
        found = client.search_runs(client.get_run(runs[good["job_id"]]["run_id"]).info.experiment_id.split(),
                                   filter_string=f"tags.`trainyard.sweep_id` = '{made['id']}'")
        return [r for r in found if "trainyard.trial" not in r.data.tags and r.info.status == "FINISHED"]
    live.wait_until(parent_sent, 60, "the sweep's run to end")
    [parent] = parent_sent()
    assert parent.data.tags["mlflow.runName"] == "lr-grid"
    assert parent.data.tags["trainyard.objective"] == "minimize val_loss"
    assert parent.data.tags["trainyard.best_job"] == str(good["job_id"])
    assert parent.data.metrics["best/val_loss"] == pytest.approx(done["best"]["value"])
    assert parent.data.metrics["trials/pruned"] == 1 and parent.data.metrics["trials/succeeded"] == 1
    assert parent.data.params["parameters.train.lr.values"] == "[0.05,1e-06]"
    for trial, status in ((good, "FINISHED"), (bad, "KILLED")):
        child = client.get_run(runs[trial["job_id"]]["run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["trainyard.trial"] == str(trial["trial"])
        assert child.info.status == status
        assert child.data.params["train.lr"] == str(trial["params"]["train.lr"])
        same_as_metrics(client, child.info.run_id, metrics(live, trial["job_id"]))
    pruned = client.get_run(runs[bad["job_id"]]["run_id"])
    assert pruned.data.tags["trainyard.pruned"] == "true" and pruned.data.tags["trainyard.error_class"] == "pruned"

    # Retried, the pruned trial runs to its end as a new run that names the first; the first stays as it ended.
    with live.client() as c:
        assert c.post(f"/jobs/{bad['job_id']}/retry").status_code == 200
    assert live.wait_state(bad["job_id"], timeout=120)["state"] == "succeeded"
    again = tracked_run(live, bad["job_id"])
    assert again["run_id"] != runs[bad["job_id"]]["run_id"]
    assert again["earlier_runs"] == [runs[bad["job_id"]]["run_id"]]
    second = client.get_run(again["run_id"])
    assert second.data.tags["trainyard.retry_of"] == runs[bad["job_id"]]["run_id"]
    assert second.info.status == "FINISHED" and client.get_run(runs[bad["job_id"]]["run_id"]).info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(again["run_id"], "val_loss")] == list(range(1, epochs + 1))
    same_as_metrics(client, again["run_id"], metrics(live, bad["job_id"]))


def test_a_job_killed_and_resumed_is_one_run_with_each_epoch_once(tracker, tmp_path):
    """On PostgreSQL (the rest of the module runs on SQLite): the sender's statements on both backends."""
    client = tracker.client()
    with fresh_database("postgres", "mlflow") as url, \
            serving(tmp_path / "data", workers=0, env=tracked_env(tracker), database_url=url) as svc:
        first = svc.start_worker("cpu")
        # A checkpoint at epoch 15 only: a kill after epoch 16 loses epochs that the resumed run reports again. The
        # kill must land within epochs 16-29 (under a second on a fast machine).
        job = svc.submit({**slow_job(epochs=30, checkpoint_every=15), "tracking": {"experiment": "resumed"}})
        svc.wait_until(lambda: svc.job(job["id"])["checkpoint_epoch"] == 15 and len(metrics(svc, job["id"])) >= 16,
                       240, "epoch 16, past the checkpoint of epoch 15")
        os.kill(first.pid, signal.SIGKILL)
        # Until it ends, the tracker gets the epochs its checkpoint holds for good (1-15), and not epoch 16 on,
        # which the resumed run does again.
        svc.wait_until(lambda: (svc.job(job["id"])["tracking"]["mlflow"] or {}).get("run_id") and len(
            client.get_metric_history(svc.job(job["id"])["tracking"]["mlflow"]["run_id"], "val_loss")) >= 15,
            30, "epochs 1-15 in the run")
        time.sleep(2)  # two more passes of the sender: nothing more is sent
        running = svc.job(job["id"])["tracking"]["mlflow"]
        assert [m.step for m in client.get_metric_history(running["run_id"], "val_loss")] == list(range(1, 16))
        assert running["complete"] is False and client.get_run(running["run_id"]).info.status == "RUNNING"
        svc.start_worker("cpu")
        done = svc.wait_state(job["id"], timeout=300)
        assert done["state"] == "succeeded" and done["runs"] == 2 and done["result"]["resumed_from_epoch"] == 15, done
        ended = tracked_run(svc, job["id"])
        assert ended["run_id"] == running["run_id"]  # the same run, continued
        assert [m.step for m in client.get_metric_history(ended["run_id"], "val_loss")] == list(range(1, 31))
        same_as_metrics(client, ended["run_id"], metrics(svc, job["id"]))
        experiment = client.get_experiment_by_name("resumed")
        assert len(client.search_runs([experiment.experiment_id])) == 1
        assert client.get_run(ended["run_id"]).data.tags["trainyard.claim"] == "2"


def test_the_tracker_down_never_holds_a_job_up_and_its_run_completes_when_it_is_back(live, tracker):
    client = tracker.client()
    # Long enough (about 1.5 s) that the tracker is down before the sender could have sent the whole run.
    job = live.submit({**slow_job(epochs=24, checkpoint_every=1), "tracking": {"experiment": "outage"}})
    live.wait_until(lambda: ((live.job(job["id"]).get("tracking") or {}).get("mlflow") or {}).get("run_id")
                    and len(client.get_metric_history(live.job(job["id"])["tracking"]["mlflow"]["run_id"],
                                                      "val_loss")) >= 1, 120, "the run's first epoch")
    tracker.stop()
    try:
        done = live.wait_state(job["id"], timeout=300)
        assert done["state"] == "succeeded", done
        live.wait_until(lambda: live.job(job["id"])["tracking"]["mlflow"]["error"], 30, "a send to fail")
        shown = live.job(job["id"])["tracking"]["mlflow"]
        assert shown["complete"] is False and shown["error"], shown
        with live.client() as c:
            scrape = c.get("/metrics").text
        assert "trainyard_tracking_backlog_runs 1.0" in scrape and "trainyard_tracking_failing_runs 1.0" in scrape
        errors = [line for line in scrape.splitlines()
                  if line.startswith('trainyard_tracking_errors_total{tracker="mlflow"}')]
        assert errors and float(errors[0].split()[-1]) >= 1
    finally:
        tracker.start()
    t0 = time.monotonic()
    ended = tracked_run(live, job["id"], timeout=60)
    print(f"run complete {time.monotonic() - t0:.1f} s after the tracker came back")
    assert ended["error"] is None and ended["status"] == "FINISHED"
    assert [m.step for m in client.get_metric_history(ended["run_id"], "val_loss")] == list(range(1, 25))
    same_as_metrics(client, ended["run_id"], metrics(live, job["id"]))
    with live.client() as c:
        assert "trainyard_tracking_backlog_runs 0.0" in c.get("/metrics").text
