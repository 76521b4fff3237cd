"""Sweep driver benchmark: what one pass of the driver costs over running sweeps of 500 and of 5,000 trials.

Run: `.venv/bin/python -m bench.sweep_pass [--sizes 500 5000] [--repeats 20]` from the repository root.

N trials are written straight into a fresh SQLite database (submitting them would take a fleet and
hours), as running sweeps of at most PER_SWEEP trials (a sweep makes at most MAX_SWEEP_TRIALS): each a
random search over train.lr, max_concurrent 2, its study's journal as the driver would have written it
(all trials told but the last 2, which run) and its trial jobs (succeeded, the last 2 running). One
Searcher loads them (its first pass: each journal replayed and each sweep's trials read, once per
process; not timed), then per repeat, in the smallest sweep: one running trial's job succeeds, and the
pass that tells the study, asks the next trial and inserts its job is timed (`a trial ends`); the new
job is claimed, and the pass that sees it start is timed (`a trial starts`); then a pass with nothing
changed (`idle`). Each column: the median over the
repeats of the pass's wall time, its SQL statements (SELECT/INSERT/UPDATE/DELETE) and the SQLite virtual
machine instructions that ran them (to the hundred: the database's work, which no load on the machine
changes).
"""
import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import BaseJournalBackend
from sqlalchemy import event, insert, update
from sqlalchemy.engine import Engine

from bench.common import env_line, table
from trainyard.app.core.settings import Settings
from trainyard.app.db import jobs, make_engine, migrate, sweep_log, sweeps, write
from trainyard.app.jobs import queue
from trainyard.app.spec import MAX_SWEEP_TRIALS, SweepSpec
from trainyard.app.sweeps import study, sweep_admission, sweep_store
from trainyard.app.sweeps.search import Searcher

RUNNING = 2
# Trials of one fabricated sweep, at most: a sweep takes at most MAX_SWEEP_TRIALS (1,000); room is left for the
# trials the repeats make.
PER_SWEEP = 950


class _Logs(BaseJournalBackend):
    """A journal in memory: the study is made here, then its entries are written in one INSERT."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
        return self.logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self.logs.extend(logs)


def sweep_spec(name: str) -> SweepSpec:
    job = {"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "data": {"dataset": "iris"},
           "train": {"epochs": 4, "batch_size": 32}, "device": "cpu"}
    return SweepSpec.model_validate({"name": name, "job": job, "method": "random", "max_trials": MAX_SWEEP_TRIALS,
                                     "max_concurrent": RUNNING, "parameters": {"train.lr": {
                                         "type": "float", "low": 1e-4, "high": 0.1, "log": True}}})


def running_sweeps(engine: Engine, settings: Settings, trials: int) -> list[int]:
    """Running sweeps of `trials` trials in all, PER_SWEEP at most each (see module docstring); their ids."""
    sizes = [PER_SWEEP] * (trials // PER_SWEEP) + ([trials % PER_SWEEP] if trials % PER_SWEEP else [])
    return [running_sweep(engine, settings, n, f"bench-{i}") for i, n in enumerate(sorted(sizes))]


def running_sweep(engine: Engine, settings: Settings, trials: int, name: str) -> int:
    """A running sweep of `trials` trials, the last RUNNING of them running; its id."""
    spec = sweep_spec(name)
    sweep_id = sweep_store.create(engine, settings, spec).id
    backend = _Logs()
    made = optuna.create_study(study_name=study.STUDY, storage=JournalStorage(backend), direction=study.direction(spec),
                               sampler=optuna.samplers.RandomSampler(seed=0))
    made.set_user_attr(study.ENCODING, study.INDEX)
    dists, values = study.distributions(spec)
    base = sweep_admission.trial_spec(spec, 0, {"train.lr": 0.01}).model_dump(mode="json")
    draw = random.Random(sweep_id)
    rows: list[dict[str, Any]] = []
    for number in range(trials):
        loss, ends = 1.0 / (1 + number), number < trials - RUNNING
        if ends:  # told: added whole (one journal entry; asking and telling makes several, and costs more)
            params = {"train.lr": 10 ** draw.uniform(-4, -1)}
            made.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=loss))
        else:
            params = study.decode(dists, values, made.ask(dists).params)
        rows.append(dict(
            kind="train", name=f"bench/trial-{number}", state="succeeded" if ends else "running",
            spec={**base, "name": f"bench/trial-{number}", "train": {**base["train"], "lr": params["train.lr"]}},
            device_req="cpu", priority=0, max_attempts=3, attempt=1, claim=1, worker_id="bench", device="cpu",
            lease_expires_at=time.time() + 3600, created_at=time.time(), started_at=time.time(),
            finished_at=time.time() if ends else None, epoch=4 if ends else 1, epochs=4,
            latest_metrics={"val_loss": loss}, result={"val_loss": loss} if ends else None, errors=[],
            sweep_id=sweep_id, sweep={"id": sweep_id, "trial": number, "params": params}))
    with write(engine) as conn:
        conn.execute(insert(sweep_log), [dict(sweep_id=sweep_id, seq=i, entry=e) for i, e in enumerate(backend.logs)])
        conn.execute(insert(jobs), rows)
        conn.execute(update(sweeps).where(sweeps.c.id == sweep_id).values(trial_count=trials))
    return sweep_id


class Work:
    """What the database does while counted: the SQL statements run (not BEGIN, COMMIT, PRAGMA...) and, on
    SQLite with steps on, the virtual machine instructions that ran them: rows read, index entries looked
    through, rows written. Unlike a time, a count that no load on the machine changes. (Counting instructions
    calls back into Python on each: a pass counted is slower, and not timed.)"""

    def __init__(self, engine: Engine, steps: bool = True) -> None:
        self.engine, self.count_steps = engine, steps
        self.statements: list[str] = []
        self.steps = 0

    def _statement(self, conn, cursor, statement: str, *rest) -> None:
        if statement.split()[0] in ("SELECT", "INSERT", "UPDATE", "DELETE"):
            self.statements.append(statement)

    def _step(self) -> int:
        self.steps += 1
        return 0  # go on

    def _checkout(self, dbapi_conn, record, proxy) -> None:
        if hasattr(dbapi_conn, "set_progress_handler"):
            dbapi_conn.set_progress_handler(self._step, 1)

    def _checkin(self, dbapi_conn, record) -> None:
        if hasattr(dbapi_conn, "set_progress_handler"):
            dbapi_conn.set_progress_handler(None, 0)

    def __enter__(self) -> "Work":
        event.listen(self.engine, "before_cursor_execute", self._statement)
        if self.count_steps:
            event.listen(self.engine.pool, "checkout", self._checkout)
            event.listen(self.engine.pool, "checkin", self._checkin)
        return self

    def __exit__(self, *exc) -> None:
        event.remove(self.engine, "before_cursor_execute", self._statement)
        if self.count_steps:
            event.remove(self.engine.pool, "checkout", self._checkout)
            event.remove(self.engine.pool, "checkin", self._checkin)


def one_pass(searcher: Searcher, counted: bool) -> tuple[float | None, int, int | None]:
    """One pass: its wall time in ms (None when counted), its SQL statements, its SQLite instructions (None
    when timed)."""
    with Work(searcher.engine, steps=counted) as work:
        t0 = time.perf_counter()
        searcher.pass_once()
        took = time.perf_counter() - t0
    return None if counted else 1000 * took, len(work.statements), work.steps if counted else None


Results = dict[str, list[tuple[float | None, int, int | None]]]


def measure(trials: int, repeats: int) -> Results:
    """Each case's passes, every other repeat timed and the others' instructions counted."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp) / "data", database_url=f"sqlite:///{tmp}/q.db", node_name="bench")
        engine = make_engine(settings.db_url)
        migrate.upgrade(engine)
        sweep_id = running_sweeps(engine, settings, trials)[0]  # the smallest: the one whose trials move
        searcher = Searcher(engine, settings)
        searcher.pass_once()  # loads the sweeps: journals replayed, trials read (once per process)
        searcher.pass_once()
        out: Results = {"a trial ends": [], "a trial starts": [], "idle": []}
        for i in range(2 * repeats):
            oldest = min(_running(engine, sweep_id))
            assert queue.succeed(engine, oldest, _claim(engine, oldest), {"val_loss": 0.5}, None)
            out["a trial ends"].append(one_pass(searcher, i % 2 == 1))
            job = queue.claim(engine, "bench", "cpu", 3600)
            assert job is not None and job.sweep_id == sweep_id
            out["a trial starts"].append(one_pass(searcher, i % 2 == 1))
            out["idle"].append(one_pass(searcher, i % 2 == 1))
        engine.dispose()
    return out


def _median(values) -> float:
    return statistics.median(v for v in values if v is not None)


def _running(engine: Engine, sweep_id: int) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(jobs.select().with_only_columns(jobs.c.id).where(
            jobs.c.sweep_id == sweep_id, jobs.c.state == "running")).scalars())


def _claim(engine: Engine, job_id: int) -> int:
    with engine.connect() as conn:
        return conn.execute(jobs.select().with_only_columns(jobs.c.claim).where(jobs.c.id == job_id)).scalar_one()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[500, 5000])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    assert args.repeats <= (MAX_SWEEP_TRIALS - PER_SWEEP) // 2, "each repeat makes two trials in one sweep"
    env = env_line()
    results = {n: measure(n, args.repeats) for n in args.sizes}
    cases = list(next(iter(results.values())))
    rows = [[case, *(f"{_median(r[0] for r in results[n][case]):.1f} ms, "
                     f"{_median(r[1] for r in results[n][case]):.0f} statements, "
                     f"{_median(r[2] for r in results[n][case]):,.0f} instructions" for n in args.sizes)]
            for case in cases]
    print(f"\n{env}")
    print(f"One driver pass over running random sweeps of up to {PER_SWEEP} trials (max_concurrent {RUNNING}), "
          f"SQLite; medians of {args.repeats} timed and {args.repeats} counted repeats\n")
    print(table(["pass", *(f"{n:,} trials" for n in args.sizes)], rows))


if __name__ == "__main__":
    main()
