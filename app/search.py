"""The search behind a sweep: Optuna decides what each trial tries (grid, random, TPE) and which
trials to stop early (median rule, ASHA); this module turns its decisions into jobs and its inputs
out of jobs.

The study lives in trainyard's database as the log of Optuna's JournalStorage (table sweep_log,
written through a backend of our own): one schema under our migrations on SQLite and PostgreSQL
alike, appends fenced by the sweep's driver lease, and any process replays it to carry the sweep on
after a restart. (Optuna's RDBStorage would bring a dozen tables and an Alembic history of its own
into our database, beside ours.) Trials' outcomes stay in the jobs table; each pass reads them and
tells the study what it has not heard yet.

One server process per host runs `Searcher` (the holder of the sweeps lock); across hosts, each sweep's
lease in the database lets one of them advance it at a time.
"""
import fcntl
import json
import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import BaseJournalBackend
from optuna.trial import TrialState
from sqlalchemy import func, insert, select
from sqlalchemy.engine import Engine

from trainyard.app import admission, queue, sweeps, wakeup
from trainyard.app.db import metrics, read, sweep_log, write
from trainyard.app.errors import Invalid
from trainyard.app.records import Job
from trainyard.app.settings import Settings
from trainyard.app.spec import ChoiceParam, FloatParam, SweepSpec
from trainyard.app.states import Failure, JobState, error_record

log = logging.getLogger("trainyard.sweeps")
optuna.logging.set_verbosity(optuna.logging.WARNING)

# A pass every this often while a sweep runs: a pruning decision reaches its job within it, and the
# job's worker stops the process within its fence check and kill grace: under 2 s in all.
PASS_S = 0.2
IDLE_S = 1.0
LEASE_S = 30.0
STUDY = "sweep"


class LostSweep(Exception):
    """The sweep ended, or another process drives it: this process stops advancing it."""


class Journal(BaseJournalBackend):
    """Optuna's journal of one sweep's study, in table sweep_log; appends fenced by the driver lease."""

    def __init__(self, engine: Engine, sweep_id: int, driver: str):
        self.engine, self.sweep_id, self.driver = engine, sweep_id, driver

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        with read(self.engine) as conn:
            return list(conn.execute(select(sweep_log.c.entry).where(
                sweep_log.c.sweep_id == self.sweep_id, sweep_log.c.seq >= log_number_from)
                .order_by(sweep_log.c.seq)).scalars())

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        with write(self.engine) as conn:
            if conn.execute(select(sweeps.sweeps.c.id).where(sweeps.driven(self.sweep_id, self.driver))
                            .with_for_update()).first() is None:
                raise LostSweep(f"sweep {self.sweep_id} is no longer driven by {self.driver}")
            seq = conn.execute(select(func.coalesce(func.max(sweep_log.c.seq) + 1, 0))
                               .where(sweep_log.c.sweep_id == self.sweep_id)).scalar_one()
            conn.execute(insert(sweep_log), [dict(sweep_id=self.sweep_id, seq=seq + i, entry=entry)
                                             for i, entry in enumerate(logs)])


def distributions(spec: SweepSpec) -> dict[str, Any]:
    """Optuna's distribution of each parameter. Choices are JSON strings: Optuna's categorical values
    are scalars, and a field may take lists (model.hidden). A grid searches every parameter's values."""
    grid = spec.grid() if spec.method == "grid" else None
    out = {}
    for path, p in spec.parameters.items():
        if grid is not None or isinstance(p, ChoiceParam):
            values = grid[path] if grid is not None else p.values
            out[path] = CategoricalDistribution([json.dumps(v) for v in values])
        elif isinstance(p, FloatParam):
            out[path] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        else:
            out[path] = IntDistribution(p.low, p.high, log=p.log, step=p.step)
    return out


def decode(dists: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's values as the job takes them (the choices back from their JSON)."""
    return {path: json.loads(v) if isinstance(dists[path], CategoricalDistribution) else v
            for path, v in params.items()}


def sampler(spec: SweepSpec, dists: dict[str, Any], made: int) -> optuna.samplers.BaseSampler:
    """Seeded by the sweep's seed and the trials made so far: a sweep carried on by another process
    after a restart draws what an uninterrupted one would have, given the same results."""
    seed = (spec.seed * 1_000_003 + made) % 2**32
    if spec.method == "grid":
        # Its seed shuffles the grid, whose ids its trials hold: the same seed for every instance.
        return optuna.samplers.GridSampler({p: d.choices for p, d in dists.items()}, seed=spec.seed)
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # constant_liar: trials still running count as poor guesses, so concurrent asks spread out.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.startup_trials, constant_liar=True)


def pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    if p is None:
        return optuna.pruners.NopPruner()
    if p.type == "median":
        # Steps are 1-based epochs and Optuna prunes from step n_warmup_steps on: no decision until
        # warmup_epochs have ended.
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_epochs + 1,
                                           interval_steps=p.interval_epochs)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_epochs, reduction_factor=p.reduction_factor)


class Searcher:
    """Advances every running sweep, one pass at a time (see module docstring)."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine, self.settings = engine, settings
        # Stable across restarts of this host's server: a restarted driver takes its sweeps back at once.
        self.driver = f"{settings.node}:{Path(settings.data_dir).resolve()}"[-200:]
        self.studies: dict[int, optuna.Study] = {}
        self.held: dict[int, float] = {}  # sweep id -> when (monotonic) our lease on it wants renewing
        # Woken as idle workers are (app/wakeup.py): a trial's job that ends is followed by the next
        # trial at once, not at the next poll. Created by the process that holds the sweeps lock.
        self.listener: wakeup.Listener | None = None

    def run(self, stop: threading.Event, lock_path: Path) -> None:
        """The loop of the one server process of this host that holds the sweeps lock."""
        with open(lock_path, "a") as lock:
            held = False
            while not stop.is_set():
                if not held:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        held = True
                        self.listener = wakeup.Listener(self.engine, "sweeps")
                    except BlockingIOError:
                        stop.wait(IDLE_S)
                        continue
                try:
                    busy = self.pass_once()
                except Exception:
                    log.exception("sweeps")
                    busy = False
                self.listener.wait(PASS_S if busy else IDLE_S)
            if self.listener is not None:
                self.listener.close()

    def poke(self) -> None:
        """A pass now (a sweep was submitted, or the server stops), if this process drives sweeps."""
        if self.listener is not None:
            self.listener.interrupt()

    def pass_once(self) -> bool:
        """Advance each running sweep once; True while any runs."""
        active = sweeps.running(self.engine)
        for gone in set(self.studies) - set(active):
            self.forget(gone)
        for sweep_id in active:
            try:
                if time.monotonic() >= self.held.get(sweep_id, 0.0):  # the lease wants renewing
                    if not sweeps.take(self.engine, sweep_id, self.driver, LEASE_S):
                        self.forget(sweep_id)  # another host drives it: our copy of its study would go stale
                        continue
                    self.held[sweep_id] = time.monotonic() + LEASE_S / 3
                self.advance(sweep_id)
            except LostSweep:
                self.forget(sweep_id)
        return bool(active)

    def forget(self, sweep_id: int) -> None:
        self.studies.pop(sweep_id, None)
        self.held.pop(sweep_id, None)

    def study(self, sweep_id: int, spec: SweepSpec) -> optuna.Study:
        if sweep_id not in self.studies:
            storage = JournalStorage(Journal(self.engine, sweep_id, self.driver))
            direction = spec.goal
            if storage.get_all_studies():
                study = optuna.load_study(study_name=STUDY, storage=storage)
            else:
                study = optuna.create_study(study_name=STUDY, storage=storage, direction=direction)
            self.studies[sweep_id] = study
        return self.studies[sweep_id]

    def advance(self, sweep_id: int) -> None:
        row = sweeps.get(self.engine, sweep_id)
        spec = SweepSpec.model_validate(row["spec"])
        study = self.study(sweep_id, spec)
        study.pruner = pruner(spec)
        # Tells go through the sampler's after_trial hook; the grid's would stop a study it thinks runs
        # under optimize(). Asks below set the sweep's own sampler.
        study.sampler = optuna.samplers.RandomSampler()
        dists = distributions(spec)
        found = {j.sweep["trial"]: j for j in sweeps.trials(self.engine, [sweep_id])[sweep_id]}
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            job = found.get(trial.number)
            if job is None:  # asked, but the process stopped before its job was inserted
                job = self.enqueue(sweep_id, spec, trial.number, decode(dists, trial.params))
                if job is None:
                    return
                found[trial.number] = job
            self.follow(study, spec, trial, job)
        trials = study.get_trials(deepcopy=False)
        # A trial whose job was cancelled by hand is the user's choice, not a failure of the sweep.
        failed = sum(t.state == TrialState.FAIL and getattr(found.get(t.number), "state", None) != JobState.CANCELLED
                     for t in trials)
        if failed >= spec.max_failed_trials:
            sweeps.finish(self.engine, sweep_id, self.driver, sweeps.FAILED,
                          f"{failed} trials failed (max_failed_trials {spec.max_failed_trials}); "
                          f"the latest: {_latest_error(found.values())}")
            return
        active = sum(t.state == TrialState.RUNNING for t in trials)
        made = len(trials)
        while made < spec.trials and active < spec.max_concurrent:
            study.sampler = sampler(spec, dists, made)
            trial = study.ask(dists)
            if self.enqueue(sweep_id, spec, trial.number, decode(dists, trial.params)) is None:
                return
            made, active = made + 1, active + 1
        if row["trial_count"] != made or row["error"] is not None:
            sweeps.note(self.engine, sweep_id, self.driver, made)
        if made >= spec.trials and active == 0:
            complete = sum(t.state == TrialState.COMPLETE for t in trials)
            if complete:
                sweeps.finish(self.engine, sweep_id, self.driver, sweeps.SUCCEEDED)
            else:
                sweeps.finish(self.engine, sweep_id, self.driver, sweeps.FAILED,
                              f"no trial completed with a {spec.metric}: {_latest_error(found.values())}")

    def enqueue(self, sweep_id: int, spec: SweepSpec, number: int, params: dict[str, Any]) -> Job | None:
        """The trial's job, inserted; None when this pass should stop (the sweep ended, or waits)."""
        try:
            job = sweeps.trial_spec(spec, number, params)
        except Invalid as e:
            # Each value alone was checked at submit; this combination of them is refused.
            sweeps.finish(self.engine, sweep_id, self.driver, sweeps.FAILED, f"trial {number} ({params}): {e}")
            return None
        try:
            admitted = admission.admit(self.engine, self.settings, job)
        except Invalid as e:
            # The fleet refuses it now (no live worker has the plugin it needs, say): the trial waits,
            # asked but without a job, and the sweep says why until a later pass inserts it.
            sweeps.waiting(self.engine, sweep_id, self.driver, f"trial {number} waits: {e}")
            return None
        return sweeps.enqueue_trial(self.engine, sweep_id, self.driver, number, params, job, admitted)

    def follow(self, study: optuna.Study, spec: SweepSpec, frozen, job: Job) -> None:
        """Tell the study what the trial's job did since the last pass: each new epoch's metric (the
        median rule compares a trial with the finished trials' epochs: every epoch is told), a
        pruning decision on a running job, and how the job ended."""
        if spec.pruner is not None and job.started_at is not None:
            trial = optuna.Trial(study, frozen._trial_id)
            for epoch, value in self.reports(job.id, spec.metric, max(frozen.intermediate_values, default=0)):
                trial.report(value, epoch)
                # Asked on every epoch, of ended jobs too: ASHA notes each trial's value at each rung then.
                # A job that has reported its last epoch is only saving its model: let it finish.
                if trial.should_prune() and job.state == JobState.RUNNING and (job.epoch or 0) < (job.epochs or 0):
                    why = error_record(Failure.PRUNED, "Pruned", _prune_reason(spec, epoch, value))
                    if queue.stop(self.engine, [job.id], why, states=(queue.RUNNING,), final=queue.FAILED):
                        study.tell(frozen.number, state=TrialState.PRUNED)
                        log.info("sweep %s: trial %s (job %s) pruned at epoch %s", job.sweep_id,
                                 frozen.number, job.id, epoch)
                    return
        if job.state == JobState.SUCCEEDED:
            value = sweeps.trial_value(job, spec.metric)
            if value is None:
                study.tell(frozen.number, state=TrialState.FAIL)
            else:
                study.tell(frozen.number, value)
        elif job.state == JobState.FAILED and sweeps.failure(job) == Failure.PRUNED:
            study.tell(frozen.number, state=TrialState.PRUNED)
        elif job.state in (JobState.FAILED, JobState.CANCELLED):
            study.tell(frozen.number, state=TrialState.FAIL)

    def reports(self, job_id: int, metric: str, after: int) -> list[tuple[int, float]]:
        with read(self.engine) as conn:
            rows = conn.execute(select(metrics.c.epoch, metrics.c.data).where(
                metrics.c.job_id == job_id, metrics.c.epoch > after).order_by(metrics.c.epoch)).all()
        return [(r.epoch, float(r.data[metric])) for r in rows
                if isinstance(r.data.get(metric), (int, float)) and not isinstance(r.data.get(metric), bool)]


def _prune_reason(spec: SweepSpec, epoch: int, value: float) -> str:
    rule = "worse than the median of the earlier trials at that epoch (median rule)" if spec.pruner.type == "median" \
        else f"outside the best 1/{spec.pruner.reduction_factor} of the trials that reached that epoch (ASHA)"
    return f"pruned at epoch {epoch}: {spec.metric} {value:.4g} is {rule}"


def _latest_error(found: Iterable[Job]) -> str:
    failed = [j for j in found if j.state == JobState.FAILED and sweeps.failure(j) != Failure.PRUNED]
    if not failed:
        return "none of its trials reported it"
    last = max(failed, key=lambda j: j.finished_at or 0)
    return f"job {last.id}: {(last.error or {}).get('message', 'failed')}"
