"""The sweep spec and the search's driver on SQLite and the real PostgreSQL server: trials are made,
told, pruned and carried on by a new process, with the queue playing the worker's part (the HTTP
and real-worker side is tests/sweeps/test_sweeps.py)."""
import json
import math
import statistics

import optuna
import pytest
from optuna.storages import JournalStorage
from sqlalchemy import event, func, select

from bench.sweep_pass import Work, running_sweeps
from tests.helpers.jobs import tiny_job
from tests.helpers.sweeps import run_trial, sweep_spec
from trainyard.app.core.errors import Invalid
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, sweep_log, sweeps
from trainyard.app.jobs import queue, submit
from trainyard.app.records import Job, job_reads, sweep_reads, sweep_results
from trainyard.app.spec import INTEGER, NUMBER, OTHER, SweepSpec, field_kind, with_params
from trainyard.app.sweeps import search, sweep_admission, sweep_store
from trainyard.app.sweeps.study import ENCODING, INDEX, STUDY, Journal, LostSweep, distributions


@pytest.fixture
def settings(tmp_path, backend_url):
    return Settings(data_dir=tmp_path / "data", database_url=backend_url, node_name="host-a")


def trial_jobs(engine, sweep_id):
    return sweep_reads.trials(engine, [sweep_id])[sweep_id]


# ---- the spec ---------------------------------------------------------------------------------------

def test_paths_resolve_to_what_the_field_holds():
    assert field_kind("train.lr", "train") == NUMBER
    assert field_kind("train.batch_size", "train") == INTEGER
    assert field_kind("model.hidden", "train") == OTHER
    assert field_kind("train.lr_schedule.min_lr", "train") == NUMBER  # below an optional object
    assert field_kind("config.width", "run") == field_kind("config.a.b", "run") == "any"
    for bad, kind in (("train.lrr", "train"), ("kind", "train"), ("config.width", "train"), ("train", "run")):
        with pytest.raises(ValueError, match="is not a field"):
            field_kind(bad, kind)


def test_values_are_set_by_path_making_the_objects_on_the_way():
    base = {"train": {"lr": 0.1}, "model": {"arch": "mlp"}}
    out = with_params(base, {"train.lr": 0.01, "train.lr_schedule.min_lr": 0.001, "model.hidden": [8, 8]})
    assert out == {"train": {"lr": 0.01, "lr_schedule": {"min_lr": 0.001}}, "model": {"arch": "mlp", "hidden": [8, 8]}}
    assert base == {"train": {"lr": 0.1}, "model": {"arch": "mlp"}}  # the base job is left alone


def test_a_grid_enumerates_choices_and_stepped_ranges():
    spec = sweep_spec(method="grid", max_trials=None, parameters={
        "train.batch_size": {"type": "int", "low": 16, "high": 64, "step": 16},
        "train.lr": {"type": "float", "low": 0.1, "high": 0.3, "step": 0.1},
        "model.hidden": {"type": "choice", "values": [[8], [16, 16]]}})
    assert spec.grid() == {"train.batch_size": [16, 32, 48, 64], "train.lr": [0.1, 0.2, 0.3],
                           "model.hidden": [[8], [16, 16]]}
    assert spec.grid_size() == spec.trials == 24
    assert sweep_spec(method="grid", max_trials=50, parameters=spec.parameters).trials == 24  # each once
    with pytest.raises(ValueError, match="no finite set"):
        sweep_spec(method="grid", parameters={"train.lr": {"type": "float", "low": 0.1, "high": 0.3}}).grid()


@pytest.mark.parametrize("parameters, field, says", [
    ({"train.lrr": {"type": "float", "low": 0.1, "high": 1}}, ("parameters", "train.lrr"), "not a field"),
    ({"model.activation": {"type": "float", "low": 0.1, "high": 1}}, ("parameters", "model.activation", "type"),
     "not a number"),
    ({"train.epochs": {"type": "float", "low": 1, "high": 5}}, ("parameters", "train.epochs", "type"), "integer"),
    ({"train.lr": {"type": "choice", "values": [0.1, -1]}}, ("parameters", "train.lr"), "greater than 0"),
    ({"model.activation": {"type": "choice", "values": ["relu", "nope"]}}, ("parameters", "model.activation"),
     "nope"),
])
def test_bad_parameters_are_refused_naming_the_field(engine, settings, parameters, field, says):
    with pytest.raises(Invalid, match=says) as e:
        sweep_admission.admit(engine, settings, sweep_spec(parameters=parameters))
    assert e.value.loc == field


def test_a_grid_larger_than_max_trials_is_refused(engine, settings):
    spec = sweep_spec(method="grid", max_trials=3, parameters={"train.lr": {"type": "choice", "values": [1, 2, 3, 4]}})
    with pytest.raises(Invalid, match="4 combinations") as e:
        sweep_admission.admit(engine, settings, spec)
    assert e.value.loc == ("max_trials",)
    with pytest.raises(Invalid, match="train job reports") as e:
        sweep_admission.admit(engine, settings, sweep_spec(metric="accuracy"))
    assert e.value.loc == ("metric",)


# ---- the driver ----------------------------------------------------------------------------------

def test_trials_are_jobs_made_up_to_max_concurrent_and_told_how_they_ended(engine, settings):
    row = sweep_store.create(engine, settings, sweep_spec())
    s = search.Searcher(engine, settings)
    s.pass_once()
    made = trial_jobs(engine, row.id)
    assert [j.sweep["trial"] for j in made] == [0, 1] and all(j.state == "queued" for j in made)
    lrs = [j.sweep["params"]["train.lr"] for j in made]
    assert len(set(lrs)) == 2 and all(1e-4 <= v <= 0.1 for v in lrs)
    assert [job_reads.get_job(engine, j.id).spec["train"]["lr"] for j in made] == lrs  # the job tries its trial's value
    s.pass_once()
    assert len(trial_jobs(engine, row.id)) == 2  # nothing more while two are queued
    run_trial(engine, [0.9, 0.5])
    s.pass_once()
    assert len(trial_jobs(engine, row.id)) == 3
    for _ in range(3):
        run_trial(engine, [0.9, 0.7])
        s.pass_once()
    got = sweep_reads.get(engine, row.id)
    assert got.state == "succeeded" and got.trial_count == 4
    study = search.Searcher(engine, settings).load(row.id).study
    assert [t.value for t in study.get_trials()] == [0.5, 0.7, 0.7, 0.7]
    assert sweep_results.best_trial(got.summary, trial_jobs(engine, row.id)).sweep["trial"] == 0


def test_a_new_process_carries_the_sweep_on_from_the_journal(engine, settings):
    row = sweep_store.create(engine, settings, sweep_spec(max_trials=6, max_concurrent=1))
    first = search.Searcher(engine, settings)
    first.pass_once()
    run_trial(engine, [0.8])
    first.pass_once()
    run_trial(engine, [0.6])
    # The server restarts: a new process, the same host, an empty cache.
    again = search.Searcher(engine, settings)
    again.pass_once()
    made = trial_jobs(engine, row.id)
    assert [j.sweep["trial"] for j in made] == [0, 1, 2]
    assert [t.value for t in again.sweeps[row.id].study.get_trials()][:2] == [0.8, 0.6]
    # A trial asked for whose job was never inserted (the process died in between) gets its job.
    with engine.begin() as conn:
        conn.execute(jobs.delete().where(jobs.c.id == made[-1].id))
    search.Searcher(engine, settings).pass_once()
    redone = trial_jobs(engine, row.id)
    assert [j.sweep["trial"] for j in redone] == [0, 1, 2]
    assert redone[-1].sweep["params"] == made[-1].sweep["params"]
    while sweep_reads.get(engine, row.id).state == "running":
        run_trial(engine, [0.7])
        again.pass_once()
    assert [j.sweep["trial"] for j in trial_jobs(engine, row.id)] == list(range(6))


def test_another_host_cannot_drive_a_sweep_while_its_driver_holds_it(engine, settings, tmp_path):
    row = sweep_store.create(engine, settings, sweep_spec())
    search.Searcher(engine, settings).pass_once()
    other = search.Searcher(engine, settings.model_copy(update={"node_name": "host-b"}))
    assert not sweep_store.take(engine, row.id, other.driver, 30)
    other.pass_once()
    assert len(trial_jobs(engine, row.id)) == 2
    with pytest.raises(LostSweep):
        Journal(engine, row.id, other.driver).append_logs([{"op_code": 0}])
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(sweep_log)).scalar_one() > 0


def test_the_median_rule_prunes_a_poor_trial_which_keeps_its_metrics(engine, settings):
    spec = sweep_spec(max_trials=3, max_concurrent=1, pruner={"type": "median", "startup_trials": 1,
                                                              "warmup_epochs": 1})
    row = sweep_store.create(engine, settings, spec)
    s = search.Searcher(engine, settings)
    s.pass_once()
    run_trial(engine, [0.9, 0.6, 0.4, 0.3])
    s.pass_once()
    bad = run_trial(engine, [1.1, 1.1], finish=False)  # running, worse than the median at epoch 2
    s.pass_once()
    pruned = job_reads.get_job(engine, bad.id)
    assert pruned.state == "pruned" and pruned.error["class"] == "pruned"
    assert "epoch 2" in pruned.error["message"] and "median" in pruned.error["message"]
    assert [m["val_loss"] for m in job_reads.get_metrics(engine, bad.id)] == [1.1, 1.1]
    assert not queue.still_ours(engine, bad.id, bad.claim)  # its worker stops the process
    assert sweep_results.counts(trial_jobs(engine, row.id))["pruned"] == 1
    assert len(trial_jobs(engine, row.id)) == 3  # and the sweep goes on
    late = run_trial(engine, [1.2, 1.2, 1.2, 1.2], finish=False)  # worse, but its last epoch is in: saving
    s.pass_once()
    assert job_reads.get_job(engine, late.id).state == "running"


def test_failing_trials_end_the_sweep_and_a_cancel_stops_the_rest(engine, settings):
    row = sweep_store.create(engine, settings, sweep_spec(max_trials=10, max_failed_trials=2))
    s = search.Searcher(engine, settings)
    s.pass_once()
    for _ in range(2):
        job = queue.claim(engine, "w", "cpu", 30)
        queue.fail(engine, job.id, job.claim, {"class": "job", "type": "E", "message": "the data does not fit"})
        s.pass_once()
    got = sweep_reads.get(engine, row.id)
    assert got.state == "failed" and "2 trials failed" in got.error and "does not fit" in got.error
    assert all(j.state in ("failed", "cancelled") for j in trial_jobs(engine, row.id))

    row = sweep_store.create(engine, settings, sweep_spec(max_trials=10))
    s.pass_once()
    running = queue.claim(engine, "w", "cpu", 30)
    sweep_store.cancel(engine, row.id)
    s.pass_once()
    found = trial_jobs(engine, row.id)
    assert len(found) == 2 and {j.state for j in found} == {"cancelled"}
    assert not queue.still_ours(engine, running.id, running.claim)
    with pytest.raises(Exception, match="only a running sweep"):
        sweep_store.cancel(engine, row.id)


def test_tpe_improves_on_its_random_start(engine, settings):
    """On a quadratic of log10(lr) (best at 1e-2) TPE's trials after its random start beat their median."""
    spec = sweep_spec(method="tpe", max_trials=16, max_concurrent=1, startup_trials=4)
    row = sweep_store.create(engine, settings, spec)
    s = search.Searcher(engine, settings)
    s.pass_once()
    values = []
    while sweep_reads.get(engine, row.id).state == "running":
        job = queue.claim(engine, "w", "cpu", 30)
        v = (math.log10(job.sweep["params"]["train.lr"]) + 2) ** 2
        queue.succeed(engine, job.id, job.claim, {"val_loss": v}, None)
        values.append(v)
        s.pass_once()
    assert len(values) == 16
    assert statistics.median(values[4:]) < statistics.median(values[:4])


def test_a_grid_tries_each_combination_once_across_passes_and_processes(engine, settings):
    spec = sweep_spec(method="grid", max_trials=None, max_concurrent=2, parameters={
        "train.lr": {"type": "choice", "values": [0.002, 0.05]},
        "model.hidden": {"type": "choice", "values": [[8], [16]]}})
    row = sweep_store.create(engine, settings, spec)
    for _ in range(2):
        search.Searcher(engine, settings).pass_once()  # a new process each time
        run_trial(engine, [0.5])
        run_trial(engine, [0.5])
    search.Searcher(engine, settings).pass_once()
    assert sweep_reads.get(engine, row.id).state == "succeeded"
    found = trial_jobs(engine, row.id)
    assert sorted(str(j.sweep["params"]) for j in found) == sorted(
        str({"train.lr": a, "model.hidden": b}) for a in (0.002, 0.05) for b in ([8], [16]))


def test_asha_keeps_the_best_fraction_at_each_rung(engine, settings):
    spec = sweep_spec(max_trials=4, max_concurrent=1, pruner={"type": "asha", "min_epochs": 1, "reduction_factor": 2})
    sweep_store.create(engine, settings, spec)
    s = search.Searcher(engine, settings)
    s.pass_once()
    run_trial(engine, [0.5, 0.4, 0.3, 0.2])
    s.pass_once()
    worse = run_trial(engine, [0.9], finish=False)  # at rung 0 (epoch 1) outside the best half of two
    s.pass_once()
    job = job_reads.get_job(engine, worse.id)
    assert job.state == "pruned" and job.error["class"] == "pruned" and "ASHA" in job.error["message"]
    better = run_trial(engine, [0.45, 0.35], finish=False)  # the best half at rungs 0 and 1: goes on
    s.pass_once()
    assert job_reads.get_job(engine, better.id).state == "running"


def test_a_trial_the_fleet_refuses_now_waits_and_a_cancelled_trial_is_no_failure(engine, settings):
    job = {"kind": "run", "entrypoint": "not_installed_here", "device": "cpu", "config": {}}
    spec = sweep_spec(job=job, metric="score", parameters={"config.x": {"type": "choice", "values": [1, 2]}},
                      max_failed_trials=1)
    with pytest.raises(Invalid, match="not_installed_here"):
        sweep_store.create(engine, settings, spec)
    with engine.begin() as conn:  # as if the workers with the plugin had gone since it was submitted
        conn.execute(sweeps.insert().values(state="running", spec=spec.model_dump(mode="json"),
                                                   created_at=0, trial_count=0))
    sweep_id = sweep_reads.running(engine)[0]
    s = search.Searcher(engine, settings)
    s.pass_once()
    got = sweep_reads.get(engine, sweep_id)
    assert got.state == "running" and "trial 0 waits" in got.error and "not_installed_here" in got.error
    assert trial_jobs(engine, sweep_id) == []

    row = sweep_store.create(engine, settings, sweep_spec(max_failed_trials=1))
    s.pass_once()
    queue.cancel(engine, trial_jobs(engine, row.id)[0].id)  # one trial cancelled by hand
    s.pass_once()
    assert sweep_reads.get(engine, row.id).state == "running"
    assert len(trial_jobs(engine, row.id)) == 3


# ---- bounds and isolation ------------------------------------------------------------------------

def journal_bytes(engine, sweep_id) -> int:
    with engine.connect() as conn:
        return sum(len(json.dumps(e)) for e in conn.execute(
            select(sweep_log.c.entry).where(sweep_log.c.sweep_id == sweep_id)).scalars())


def test_choices_are_journaled_as_indices_however_large_their_values(engine, settings):
    # 1,000 values of ~100 bytes: a trial's journal entries held them all (100 KB a trial) before.
    hidden = [[i + 1] + [64] * 15 for i in range(1000)]
    spec = sweep_spec(max_trials=20, max_concurrent=8,
                      parameters={"model.hidden": {"type": "choice", "values": hidden}})
    row = sweep_store.create(engine, settings, spec)
    s = search.Searcher(engine, settings)
    s.pass_once()
    made = trial_jobs(engine, row.id)
    assert len(made) == 8 and all(j.sweep["params"]["model.hidden"] in hidden for j in made)
    assert [job_reads.get_job(engine, j.id).spec["model"]["hidden"] for j in made] == [j.sweep["params"]["model.hidden"]
                                                                                   for j in made]
    assert journal_bytes(engine, row.id) / 8 < 8_000
    # The draws are the same as over the values themselves (Optuna draws a categorical's index either way).
    assert len({str(j.sweep["params"]["model.hidden"]) for j in made}) == 8


def test_a_sweep_whose_journal_holds_the_values_carries_on(engine, settings):
    """A study made by the release before (choices journaled as JSON strings) goes on as it was made."""
    spec = sweep_spec(max_trials=3, max_concurrent=1, parameters={
        "model.hidden": {"type": "choice", "values": [[8], [16, 16]]}, "train.lr": {"type": "float", "low": 0.001,
                                                                                 "high": 0.1}})
    row = sweep_store.create(engine, settings, spec)
    driver = search.Searcher(engine, settings).driver
    assert sweep_store.take(engine, row.id, driver, 30)
    old = optuna.create_study(study_name=STUDY, storage=JournalStorage(Journal(engine, row.id, driver)))
    first = old.ask(distributions(spec, index=False)[0])  # its process stopped before inserting the job
    assert isinstance(first.params["model.hidden"], str)
    s = search.Searcher(engine, settings)
    s.pass_once()
    made = trial_jobs(engine, row.id)
    assert made[0].sweep["params"] == {"model.hidden": json.loads(first.params["model.hidden"]),
                                       "train.lr": first.params["train.lr"]}
    while sweep_reads.get(engine, row.id).state == "running":
        run_trial(engine, [0.5])
        s.pass_once()
    found = trial_jobs(engine, row.id)
    assert len(found) == 3 and all(j.sweep["params"]["model.hidden"] in ([8], [16, 16]) for j in found)
    assert sweep_reads.get(engine, row.id).state == "succeeded"


def test_a_sweep_whose_search_fails_ends_failed_and_the_others_go_on(engine, settings):
    bad = sweep_spec().model_dump(mode="json")
    # Stored by a release that took it: every pass of the one before failed, for every sweep after it.
    bad["parameters"] = {"train.lr": {"type": "float", "low": 1e-300, "high": 1.7e308, "step": 1e-300, "log": False}}
    with engine.begin() as conn:
        conn.execute(sweeps.insert().values(state="running", spec=bad, created_at=0, trial_count=0))
    good = sweep_store.create(engine, settings, sweep_spec())
    # A trial whose values were half drawn when its process stopped is drawn in full before it runs.
    half = sweep_store.create(engine, settings, sweep_spec(parameters={
        "train.lr": {"type": "float", "low": 0.001, "high": 0.1},
        "model.hidden": {"type": "choice", "values": [[8], [9]]}}))
    s = search.Searcher(engine, settings)
    assert sweep_store.take(engine, half.id, s.driver, 30)
    study = optuna.create_study(study_name=STUDY,
                                storage=JournalStorage(Journal(engine, half.id, s.driver)))
    study.set_user_attr(ENCODING, INDEX)
    study.ask().suggest_float("train.lr", 0.001, 0.1)
    s.pass_once()
    broken = sweep_reads.get(engine, good.id - 1)
    assert broken.state == "failed" and "the search failed" in broken.error and "train.lr" in broken.error
    assert len(trial_jobs(engine, good.id)) == 2
    halves = trial_jobs(engine, half.id)
    assert len(halves) == 2 and all(set(j.sweep["params"]) == {"train.lr", "model.hidden"} for j in halves)


def test_a_clients_idempotency_key_cannot_take_a_trials_place(engine, settings):
    squatter, _ = submit.enqueue(engine, SweepSpec.model_validate(
        {"job": tiny_job(), "parameters": {"train.lr": {"type": "choice", "values": [0.1]}}}).job, "sweep-1-trial-0")
    row = sweep_store.create(engine, settings, sweep_spec())
    s = search.Searcher(engine, settings)
    s.pass_once()
    made = trial_jobs(engine, row.id)
    assert [j.sweep["trial"] for j in made] == [0, 1] and squatter.id not in [j.id for j in made]
    assert job_reads.get_job(engine, squatter.id).sweep is None


def test_a_pass_over_idle_sweeps_reads_only_what_changed(engine, settings):
    ids = [sweep_store.create(engine, settings, sweep_spec(max_concurrent=1)).id for _ in range(30)]
    s = search.Searcher(engine, settings)
    s.pass_once()
    s.pass_once()  # sees the trials its last pass made
    statements = []

    def seen(conn, cursor, statement, *rest):
        if statement.split()[0] in ("SELECT", "INSERT", "UPDATE", "DELETE"):  # not BEGIN, SET, ...
            statements.append(statement)
    event.listen(engine, "before_cursor_execute", seen)
    try:
        s.pass_once()
        assert len(statements) == 1, statements  # which sweeps run, and whether their trials moved: one query
        run_trial(engine, [0.5])  # one trial ends: its sweep alone is advanced
        statements.clear()
        s.pass_once()
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert sum(len(trial_jobs(engine, i)) for i in ids) == 31
    assert len(statements) < 30, len(statements)  # the 30 sweeps were each read at least once before


def test_a_pass_over_5000_trials_costs_what_changed_not_the_trials_made(engine, settings, monkeypatch):
    """Six running sweeps, 5,000 trials between them (two running in each), written straight into the database:
    once the driver has loaded them, a pass reads the running sweeps and their running trials' jobs, and a
    trial that ends costs its own sweep's follow-up (tell, ask, insert), whatever the trials made. Counted,
    not timed: SQL statements, the trial job rows decoded and, on SQLite, the database's instructions (the
    pass that read every trial job of every running sweep ran some 200,000 of them here)."""
    ids = running_sweeps(engine, settings, 5000)
    s = search.Searcher(engine, settings)
    s.pass_once()  # loads each sweep: its journal replayed, its trials read (once per process)
    s.pass_once()
    decoded = []
    from_values = Job.from_values
    monkeypatch.setattr(Job, "from_values", classmethod(lambda cls, m: decoded.append(m["id"]) or from_values(m)))
    sqlite = engine.dialect.name == "sqlite"

    with Work(engine) as idle:
        s.pass_once()
    assert len(idle.statements) == 1 and decoded == [], (idle.statements, decoded)
    assert not sqlite or idle.steps < 1_000, idle.steps

    biggest = ids[-1]
    running = [j for j in trial_jobs(engine, biggest) if j.state == "running"]
    assert len(trial_jobs(engine, biggest)) == 950 and len(running) == 2
    assert queue.succeed(engine, running[0].id, running[0].claim, {"val_loss": 0.25}, None)
    decoded.clear()
    with Work(engine) as ended:
        s.pass_once()
    read = set(decoded)
    made = trial_jobs(engine, biggest)
    assert len(made) == 951 and made[-1].state == "queued"  # the trial that ended was followed by the next
    assert read <= {j.id for j in running} | {made[-1].id}, read  # its running trials', and the new one's
    assert not sqlite or ended.steps < 5_000, ended.steps

    job = queue.claim(engine, "w", "cpu", 30)
    assert job is not None and job.id == made[-1].id
    decoded.clear()
    with Work(engine) as started:
        s.pass_once()
    assert set(decoded) <= {running[1].id, job.id}, decoded
    assert not sqlite or started.steps < 1_000, started.steps
