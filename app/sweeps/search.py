"""The sweeps' driver: `Searcher` advances every running sweep, a pass at a time, turning its study's
decisions (app/sweeps/study.py) into trial jobs and its trial jobs' outcomes into the study's inputs. It calls the
sweep store (app/sweeps/sweep_store.py), the reads and the queue; none of them calls it.

A pass costs what changed, not how many trials the sweeps have made: one query by index and primary key
says which sweeps run and how their running trials' jobs stand, and only the sweeps whose running trials
moved are advanced, from what this process keeps of each (its parsed spec, distributions and study; the
ids of its trials' jobs). A sweep's finished trials are read once per process, when it loads the sweep.

One server process per host runs `Searcher` (the holder of the sweeps lock); across hosts, each sweep's
lease in the database lets one of them advance it at a time.
"""
import fcntl
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from trainyard.app.accounts import Principal
from trainyard.app.core.errors import Invalid
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import SweepState
from trainyard.app.db import wakeup
from trainyard.app.jobs import admission
from trainyard.app.records import Job, sweep_reads
from trainyard.app.records.sweep_results import latest_error, trial_number
from trainyard.app.spec import SweepSpec
from trainyard.app.sweeps import sweep_store
from trainyard.app.sweeps.study import ENCODING, INDEX, LostSweep, decode, distributions, open_study, sampler, suggest
from trainyard.app.sweeps.sweep_admission import trial_spec
from trainyard.app.sweeps.trial_outcomes import counts_as_failed, follow

log = logging.getLogger("trainyard.sweeps")

# A pass every this often while a sweep runs: a pruning decision reaches its job within it, and the
# job's worker stops the process within its fence check and kill grace: under 2 s in all.
PASS_S = 0.2
IDLE_S = 1.0
LEASE_S = 30.0
# New trials one pass asks of one sweep, at most: a sweep with a large max_concurrent makes its trials over
# several passes (each trial's job is admitted: tens of ms), while the others' passes go on between them.
ASKS_PER_PASS = 16


@dataclass
class Drive:
    """What the driver keeps of a sweep between passes, made once per process: the stored spec never changes,
    and the study and the trials' jobs change only through this process while it holds the sweep."""
    spec: SweepSpec
    dists: dict[str, BaseDistribution]
    values: dict[str, list]    # each choice's values (a grid's: every parameter's), by index
    study: optuna.Study
    jobs: dict[int, int]       # trial number -> its job's id
    failed: int                # trials failed, not pruned or cancelled by hand: max_failed_trials counts them
    trial_count: int           # what the sweep's row says: trials made,
    waits: bool                # and whether its error says why a trial waits
    known: int = 0             # the highest job id among its trials' when it was loaded: it knows them all
    running: set[int] = field(default_factory=set)  # the trials the study has running, as of the last pass
    seen: tuple | None = None  # its running trials' jobs as they stood (sweep_reads.watch) when a pass last
    #                            left nothing to do
    who: Principal | None = None  # whom its trials are admitted as: its owner (sweep_reads.owner_of)

    def watched(self) -> list[int]:
        """The jobs of its running trials: the ones whose change gives it something to do."""
        return [self.jobs[n] for n in self.running if n in self.jobs]

    def signature(self, moved: dict[int, tuple]) -> tuple:
        return tuple((j, moved.get(j)) for j in sorted(self.watched()))


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
        # Woken as idle workers are (app/db/wakeup.py): a trial's job that ends is followed by the next
        # trial at once, not at the next poll. Created by the process that holds the sweeps lock.
        self.listener: wakeup.Listener | None = None

    def run(self, stop: threading.Event, lock_path: Path) -> None:
        """The loop of the one server process of this host that holds the sweeps lock."""
        with open(lock_path, "a") as lock:
            while not stop.is_set():
                if self.listener is None:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
        """Advance each running sweep whose running trials' jobs changed since it last had nothing to do (one
        query tells which); True while any runs. A sweep whose search fails ends failed, alone."""
        active, moved = sweep_reads.watch(self.engine, [j for d in self.sweeps.values() for j in d.watched()])
        for gone in set(self.sweeps) | self.held | set(self.renew):
            if gone not in active:
                self.forget(gone)
                self.renew.pop(gone, None)
        self.lease(active)
        for sweep_id in active:
            d = self.sweeps.get(sweep_id)
            signature = None if d is None else d.signature(moved)
            if sweep_id not in self.held or (d is not None and d.seen is not None and d.seen == signature):
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
                self.end(sweep_id, SweepState.FAILED, f"the search failed: {type(e).__name__}: {e}")
        return bool(active)

    def lease(self, active: list[int]) -> None:
        """Renew our leases, all in one write, once one wants it (a third of the way through); sweeps another
        host holds are tried once a second (taken over when their driver is gone and its lease has run out)."""
        now = time.monotonic()
        if not any(now >= self.renew.get(i, 0.0) for i in active):
            return
        wanted = [i for i in active if i in self.held or now >= self.renew.get(i, 0.0)]
        got = sweep_store.hold(self.engine, wanted, self.driver, LEASE_S)
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
        first pass), its trials' jobs (read whole this once)."""
        row = sweep_reads.get(self.engine, sweep_id)
        assert row.spec is not None
        spec = SweepSpec.model_validate(row.spec)
        study = open_study(self.engine, sweep_id, self.driver, spec)
        study.sampler = self.teller
        dists, values = distributions(spec, index=study.user_attrs.get(ENCODING) == INDEX)
        listed = sweep_reads.trials(self.engine, [sweep_id])[sweep_id]
        found = {trial_number(j): j for j in listed}
        trials = study.get_trials(deepcopy=False)
        failed = sum(counts_as_failed(found.get(t.number)) for t in trials if t.state == TrialState.FAIL)
        return Drive(spec, dists, values, study, {n: j.id for n, j in found.items()}, failed, row.trial_count,
                     row.error is not None, max((j.id for j in listed), default=0),
                     {t.number for t in trials if t.state == TrialState.RUNNING},
                     who=sweep_reads.owner_of(self.engine, row))

    def advance(self, sweep_id: int, d: Drive) -> bool:
        """Follow the sweep's running trials, then ask for more up to max_concurrent, or end it. True: nothing
        is left to do until one of its jobs changes; False: pass again (a trial waits for the fleet)."""
        spec, study = d.spec, d.study
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        found = sweep_reads.jobs_by_id(self.engine, [d.jobs[t.number] for t in running if t.number in d.jobs])
        for frozen in running:
            job = found.get(d.jobs.get(frozen.number, 0))
            if job is None:  # asked, but the process stopped before its job was inserted
                params = frozen.params
                if set(params) != set(d.dists):  # or even before its values were all drawn
                    params = self.draw(d, frozen.number, frozen._trial_id).params
                job = self.enqueue(sweep_id, d, frozen.number, params)
                if job is None:
                    return False
            d.failed += follow(self.engine, spec, study, frozen, job)
        if d.failed >= spec.max_failed_trials:
            why = f"{d.failed} trials failed (max_failed_trials {spec.max_failed_trials})"
            self.end(sweep_id, SweepState.FAILED, f"{why}; the latest: {self.latest_error(sweep_id)}")
            return True
        trials = study.get_trials(deepcopy=False)
        d.running = {t.number for t in trials if t.state == TrialState.RUNNING}
        made = asked = len(trials)
        while made < spec.trials and len(d.running) < spec.max_concurrent and made - asked < ASKS_PER_PASS:
            new = self.draw(d, made)
            d.running.add(new.number)
            if self.enqueue(sweep_id, d, new.number, new.params) is None:
                return False
            made += 1
        if d.trial_count != made or d.waits:
            sweep_store.note(self.engine, sweep_id, self.driver, made)
            d.trial_count, d.waits = made, False
        if made >= spec.trials and not d.running:
            if any(t.state == TrialState.COMPLETE for t in trials):
                self.end(sweep_id, SweepState.SUCCEEDED)
            else:
                self.end(sweep_id, SweepState.FAILED,
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
            job = trial_spec(d.spec, number, params)
        except Invalid as e:
            # Each value alone was checked at submit; this combination of them is refused.
            self.end(sweep_id, SweepState.FAILED, f"trial {number} ({json.dumps(params)[:500]}): {e}")
            return None
        try:
            admitted = admission.admit(self.engine, self.settings, job, who=d.who)
        except Invalid as e:
            # The fleet refuses it now (no live worker has the plugin it needs, say): the trial waits,
            # asked but without a job, and the sweep says why until a later pass inserts it.
            sweep_store.waiting(self.engine, sweep_id, self.driver, f"trial {number} waits: {e}")
            d.waits = True
            return None
        made = sweep_store.enqueue_trial(self.engine, sweep_id, self.driver, number, params, job, admitted,
                                         known=d.known)
        if made is not None:
            d.jobs[number] = made.id
        return made

    def end(self, sweep_id: int, state: SweepState, why: str | None = None) -> None:
        self.forget(sweep_id)
        try:
            sweep_store.finish(self.engine, sweep_id, self.driver, state, why if why is None else why[:2000])
        except SQLAlchemyError:
            log.exception("sweep %s", sweep_id)  # still running in the database: a later pass ends it

    def latest_error(self, sweep_id: int) -> str:
        return latest_error(sweep_reads.trials(self.engine, [sweep_id])[sweep_id])
