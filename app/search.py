"""The search behind a sweep: Optuna decides what each trial tries (grid, random, TPE) and which
trials to stop early (median rule, ASHA); this module turns its decisions into jobs and its inputs
out of jobs.

The study lives in trainyard's database as the log of Optuna's JournalStorage (table sweep_log,
written through a backend of our own): one schema under our migrations on SQLite and PostgreSQL
alike, appends fenced by the sweep's driver lease, and any process replays it to carry the sweep on
after a restart. (Optuna's RDBStorage would bring a dozen tables and an Alembic history of its own
into our database, beside ours.) Trials' outcomes stay in the jobs table; each pass reads them and
tells the study what it has not heard yet. A pass costs what changed: one query says which running
sweeps' trial jobs moved since their last pass, and only those are advanced, from what this process
keeps of each (its parsed spec, distributions and study; the ids of its trials' jobs).

One server process per host runs `Searcher` (the holder of the sweeps lock); across hosts, each sweep's
lease in the database lets one of them advance it at a time.
"""
import fcntl
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import BaseJournalBackend
from optuna.trial import TrialState
from sqlalchemy import func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

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
# New trials one pass asks of one sweep, at most: a sweep with a large max_concurrent makes its trials over
# several passes (each trial's job is admitted: tens of ms), while the others' passes go on between them.
ASKS_PER_PASS = 16


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


# A study made by this release holds each choice as an index into its values (study user attr ENCODING):
# Optuna journals every trial's distributions in full, and choices' values (any JSON, thousands of them)
# made each trial's entries megabytes, and the replay a copy per trial. Studies without it (made before)
# hold the values as JSON strings, and are carried on as they were made.
ENCODING = "trainyard.choices"
INDEX = "index"


def distributions(spec: SweepSpec, index: bool = True) -> tuple[dict[str, Any], dict[str, list]]:
    """Optuna's distribution of each parameter, and the values of those that are choices (a grid searches
    every parameter's values): a choice's distribution is over the indices of its values, or (index False,
    a study made before) over the values as JSON strings, Optuna's categorical values being scalars."""
    grid = spec.grid() if spec.method == "grid" else None
    dists, values = {}, {}
    for path, p in spec.parameters.items():
        if grid is not None or isinstance(p, ChoiceParam):
            values[path] = grid[path] if grid is not None else p.values
            dists[path] = CategoricalDistribution(list(range(len(values[path]))) if index
                                                  else [json.dumps(v) for v in values[path]])
        elif isinstance(p, FloatParam):
            dists[path] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        else:
            dists[path] = IntDistribution(p.low, p.high, log=p.log, step=p.step)
    return dists, values


def decode(dists: dict[str, Any], values: dict[str, list], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's values as the job takes them: a choice's value from its index (or its JSON string)."""
    def value(path, v):
        if path not in values:
            return v
        return json.loads(v) if isinstance(v, str) else values[path][v]
    return {path: value(path, v) for path, v in params.items()}


def suggest(trial: optuna.Trial, dists: dict[str, Any]) -> None:
    """Draw each parameter the trial has not drawn yet (all of a new trial's): study.ask(dists), also for a
    trial whose drawing a stopped process left half done. A parameter drawn already keeps its value."""
    for path, d in dists.items():
        if isinstance(d, CategoricalDistribution):
            trial.suggest_categorical(path, d.choices)
        elif isinstance(d, IntDistribution):
            trial.suggest_int(path, d.low, d.high, step=d.step, log=d.log)
        else:
            trial.suggest_float(path, d.low, d.high, step=d.step, log=d.log)


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


@dataclass
class Drive:
    """What the driver keeps of a sweep between passes, made once per process: the stored spec never changes,
    and the study and the trials' jobs change only through this process while it holds the sweep."""
    spec: SweepSpec
    dists: dict[str, Any]
    values: dict[str, list]    # each choice's values (a grid's: every parameter's), by index
    study: optuna.Study
    jobs: dict[int, int]       # trial number -> its job's id
    failed: int                # trials failed, not pruned or cancelled by hand: max_failed_trials counts them
    trial_count: int           # what the sweep's row says: trials made,
    waits: bool                # and whether its error says why a trial waits
    seen: tuple | None = None  # its trial jobs' signature (sweeps.activity) when a pass last left nothing to do


class Searcher:
    """Advances every running sweep, one pass at a time (see module docstring)."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine, self.settings = engine, settings
        # Stable across restarts of this host's server: a restarted driver takes its sweeps back at once.
        self.driver = f"{settings.node}:{Path(settings.data_dir).resolve()}"[-200:]
        self.sweeps: dict[int, Drive] = {}
        self.held: set[int] = set()         # the sweeps whose lease this process holds
        self.renew: dict[int, float] = {}   # sweep id -> when (monotonic) to renew our lease, or try to take it
        # Tells go through the sampler's after_trial hook; the grid's would stop a study it thinks runs under
        # optimize(). Asks set the sweep's own sampler, and put this one back.
        self.teller = optuna.samplers.RandomSampler()
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
        """Advance each running sweep whose trial jobs changed since it last had nothing to do (one query
        tells which); True while any runs. A sweep whose search fails ends failed, alone."""
        active = sweeps.activity(self.engine)
        for gone in set(self.sweeps) | self.held | set(self.renew):
            if gone not in active:
                self.forget(gone)
                self.renew.pop(gone, None)
        self.lease(list(active))
        for sweep_id, signature in active.items():
            d = self.sweeps.get(sweep_id)
            if sweep_id not in self.held or (d is not None and d.seen == signature):
                continue
            try:
                d = d or self.load(sweep_id)
                self.sweeps[sweep_id] = d
                d.seen = signature if self.advance(sweep_id, d) else None
            except LostSweep:
                self.forget(sweep_id)
            except SQLAlchemyError:
                # The database's trouble, not the sweep's: the next pass carries on from the journal (the
                # lease is still ours).
                log.exception("sweep %s", sweep_id)
                self.sweeps.pop(sweep_id, None)
            except Exception as e:
                # This sweep's search cannot go on (a space Optuna cannot draw from, say): it ends failed,
                # saying why, and the other sweeps carry on.
                log.exception("sweep %s", sweep_id)
                self.end(sweep_id, sweeps.FAILED, f"the search failed: {type(e).__name__}: {e}")
        return bool(active)

    def lease(self, active: list[int]) -> None:
        """Renew our leases, all in one write, once one wants it (a third of the way through); sweeps another
        host holds are tried once a second (taken over when their driver is gone and its lease has run out)."""
        now = time.monotonic()
        if not any(now >= self.renew.get(i, 0.0) for i in active):
            return
        wanted = [i for i in active if i in self.held or now >= self.renew.get(i, 0.0)]
        got = sweeps.hold(self.engine, wanted, self.driver, LEASE_S)
        for sweep_id in wanted:
            if sweep_id in got:
                self.held.add(sweep_id)
                self.renew[sweep_id] = now + LEASE_S / 3
            else:
                self.forget(sweep_id)  # another host drives it: our copy of its study would go stale
                self.renew[sweep_id] = now + IDLE_S

    def forget(self, sweep_id: int) -> None:
        self.sweeps.pop(sweep_id, None)
        self.held.discard(sweep_id)

    def load(self, sweep_id: int) -> Drive:
        """The sweep as this process drives it: its spec, its study (replayed from the journal, or made on its
        first pass), its trials' jobs."""
        row = sweeps.get(self.engine, sweep_id)
        spec = SweepSpec.model_validate(row["spec"])
        storage = JournalStorage(Journal(self.engine, sweep_id, self.driver))
        if storage.get_all_studies():
            study = optuna.load_study(study_name=STUDY, storage=storage)
        else:
            study = optuna.create_study(study_name=STUDY, storage=storage, direction=spec.goal)
            study.set_user_attr(ENCODING, INDEX)
        dists, values = distributions(spec, index=study.user_attrs.get(ENCODING) == INDEX)
        study.pruner, study.sampler = pruner(spec), self.teller
        found = {j.sweep["trial"]: j for j in sweeps.trials(self.engine, [sweep_id])[sweep_id]}
        failed = sum(_counts_as_failed(found.get(t.number))
                     for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
        return Drive(spec, dists, values, study, {n: j.id for n, j in found.items()}, failed, row["trial_count"],
                     row["error"] is not None)

    def advance(self, sweep_id: int, d: Drive) -> bool:
        """Follow the sweep's running trials, then ask for more up to max_concurrent, or end it. True: nothing
        is left to do until one of its jobs changes; False: pass again (a trial waits for the fleet)."""
        spec, study = d.spec, d.study
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        found = sweeps.jobs_by_id(self.engine, [d.jobs[t.number] for t in running if t.number in d.jobs])
        for trial in running:
            job = found.get(d.jobs.get(trial.number, 0))
            if job is None:  # asked, but the process stopped before its job was inserted
                if set(trial.params) != set(d.dists):  # or even before its values were all drawn
                    trial = self.draw(d, trial.number, trial._trial_id)
                job = self.enqueue(sweep_id, d, trial.number, trial.params)
                if job is None:
                    return False
            self.follow(d, trial, job)
        if d.failed >= spec.max_failed_trials:
            self.end(sweep_id, sweeps.FAILED, f"{d.failed} trials failed (max_failed_trials {spec.max_failed_trials}); "
                                              f"the latest: {self.latest_error(sweep_id)}")
            return True
        trials = study.get_trials(deepcopy=False)
        active = sum(t.state == TrialState.RUNNING for t in trials)
        made = asked = len(trials)
        while made < spec.trials and active < spec.max_concurrent and made - asked < ASKS_PER_PASS:
            trial = self.draw(d, made)
            if self.enqueue(sweep_id, d, trial.number, trial.params) is None:
                return False
            made, active = made + 1, active + 1
        if d.trial_count != made or d.waits:
            sweeps.note(self.engine, sweep_id, self.driver, made)
            d.trial_count, d.waits = made, False
        if made >= spec.trials and active == 0:
            if any(t.state == TrialState.COMPLETE for t in trials):
                self.end(sweep_id, sweeps.SUCCEEDED)
            else:
                self.end(sweep_id, sweeps.FAILED,
                         f"no trial completed with a {spec.metric}: {self.latest_error(sweep_id)}")
        return made - asked < ASKS_PER_PASS

    def draw(self, d: Drive, number: int, trial_id: int | None = None) -> optuna.Trial:
        """A new trial (asked now, the number-th) or one a stopped process left half drawn (trial_id), with
        every parameter drawn by the sweep's sampler as of that number. A trial is never run without its
        values: a draw that raises half way fails the sweep (pass_once), not a trial without them."""
        d.study.sampler = sampler(d.spec, d.dists, number)
        try:
            trial = d.study.ask() if trial_id is None else optuna.Trial(d.study, trial_id)
            suggest(trial, d.dists)
        finally:
            d.study.sampler = self.teller
        return trial

    def enqueue(self, sweep_id: int, d: Drive, number: int, drawn: dict[str, Any]) -> Job | None:
        """The trial's job, inserted; None when this pass should stop (the sweep ended, or waits)."""
        params = decode(d.dists, d.values, drawn)
        try:
            job = sweeps.trial_spec(d.spec, number, params)
        except Invalid as e:
            # Each value alone was checked at submit; this combination of them is refused.
            self.end(sweep_id, sweeps.FAILED, f"trial {number} ({json.dumps(params)[:500]}): {e}")
            return None
        try:
            admitted = admission.admit(self.engine, self.settings, job)
        except Invalid as e:
            # The fleet refuses it now (no live worker has the plugin it needs, say): the trial waits,
            # asked but without a job, and the sweep says why until a later pass inserts it.
            sweeps.waiting(self.engine, sweep_id, self.driver, f"trial {number} waits: {e}")
            d.waits = True
            return None
        made = sweeps.enqueue_trial(self.engine, sweep_id, self.driver, number, params, job, admitted)
        if made is not None:
            d.jobs[number] = made.id
        return made

    def end(self, sweep_id: int, state: str, why: str | None = None) -> None:
        self.forget(sweep_id)
        try:
            sweeps.finish(self.engine, sweep_id, self.driver, state, why if why is None else why[:2000])
        except SQLAlchemyError:
            log.exception("sweep %s", sweep_id)  # still running in the database: a later pass ends it

    def latest_error(self, sweep_id: int) -> str:
        return _latest_error(sweeps.trials(self.engine, [sweep_id])[sweep_id])

    def follow(self, d: Drive, frozen, job: Job) -> None:
        """Tell the study what the trial's job did since the last pass: each new epoch's metric (the
        median rule compares a trial with the finished trials' epochs: every epoch is told), a
        pruning decision on a running job, and how the job ended."""
        spec, study = d.spec, d.study
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
        value = sweeps.trial_value(job, spec.metric) if job.state == JobState.SUCCEEDED else None
        if value is not None:
            study.tell(frozen.number, value)
        elif job.state == JobState.FAILED and sweeps.failure(job) == Failure.PRUNED:
            study.tell(frozen.number, state=TrialState.PRUNED)
        elif job.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
            study.tell(frozen.number, state=TrialState.FAIL)
            d.failed += _counts_as_failed(job)

    def reports(self, job_id: int, metric: str, after: int) -> list[tuple[int, float]]:
        with read(self.engine) as conn:
            rows = conn.execute(select(metrics.c.epoch, metrics.c.data).where(
                metrics.c.job_id == job_id, metrics.c.epoch > after).order_by(metrics.c.epoch)).all()
        return [(r.epoch, float(r.data[metric])) for r in rows
                if isinstance(r.data.get(metric), (int, float)) and not isinstance(r.data.get(metric), bool)]


def _counts_as_failed(job: Job | None) -> bool:
    """A trial that failed counts against max_failed_trials unless its job was cancelled by hand (the
    user's choice, not a failure of the sweep)."""
    return getattr(job, "state", None) != JobState.CANCELLED


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
