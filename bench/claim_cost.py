"""The claim's and an idle worker's poll's cost, in one process: CPU time and SQL statements, on SQLite and
PostgreSQL, with and without a fleet's history; and `build_history`, that history, for bench/dispatch.py too.

Run: `.venv/bin/python -m bench.claim_cost [--backend sqlite|postgres|both] [--lines N]` from the repository root.

For each backend, on a fresh database (a SQLite file, a schema of the local PostgreSQL's `test` database), with
no history and then with build_history's (50 projects with a member each, 200 jobs apiece that ran and ended
within the last hour: 10,000 rows), one registered CPU worker:
  - idle poll: what an idle worker's look at the queue costs when nothing is queued and nothing changed since
    its last look (a safety-net poll, not a wake-up), as worker/supervisor/main.py makes it;
  - claim cycle, one project: a job of the admin's queued, then the worker's look and its claim;
  - claim cycle, two projects: jobs of two projects queued (fair share must order them), look and claim.
Each figure is CPU time of this process (time.process_time) per call, a median over rounds, and the statements
the call sent (a before_cursor_execute event on the engine): the machine is shared by other work, so wall-clock
times would measure it too. The database server's own CPU (PostgreSQL) is not in these figures; the statement
count stands for it. --lines N prints the N costliest functions (cProfile, cumulative) of the idle poll and the
claim cycle with history.
"""
import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from sqlalchemy import event, insert, select, update
from sqlalchemy.engine import Engine

from bench.common import TINY_JOB, postgres_schema, table
from trainyard.app.db import db_now, jobs, make_engine, members, migrate, projects, users, write
from trainyard.app.fleet import placement, workers
from trainyard.app.jobs import queue
from trainyard.app.jobs.submit import enqueue
from trainyard.app.spec import parse_spec

try:
    from trainyard.app.fleet import idle_look
except ImportError:  # the code before issue 40, measured for the "before" column
    idle_look = None  # type: ignore[assignment]

PROJECTS, PER_PROJECT = 50, 200
WORKER = "bench-worker"


def build_history(url: str, projects_n: int = PROJECTS, per_project: int = PER_PROJECT) -> None:
    """projects_n projects with a member each, and per_project jobs apiece that ran (10 to 60 s, spread over the
    last hour by the database's clock) and succeeded: written in one transaction, in bulk."""
    engine = make_engine(url)
    try:
        with write(engine) as conn:
            now = conn.execute(select(db_now())).scalar_one()
            for p in range(projects_n):
                pid = conn.execute(insert(projects).values(name=f"fleet-{p}", share=1.0, limits={},
                                                           created_at=now).returning(projects.c.id)).scalar_one()
                uid = conn.execute(insert(users).values(name=f"fleet-user-{p}", admin=False, created_at=now)
                                   .returning(users.c.id)).scalar_one()
                conn.execute(insert(members).values(user_id=uid, project_id=pid))
                rows = []
                for k in range(per_project):
                    end = now - 3500.0 * (k + 0.5) / per_project
                    start = end - 10.0 - (k * 7 + p) % 50
                    rows.append(dict(kind="train", state="succeeded", spec=TINY_JOB, device_req="cpu", priority=0,
                                     max_attempts=3, attempt=1, claim=1, worker_id="gone", device="cpu",
                                     created_at=start - 1.0, queued_at=start - 1.0, started_at=start,
                                     finished_at=end, errors=[], result={}, epoch=1, epochs=1, project_id=pid,
                                     owner=f"fleet-user-{p}"))
                conn.execute(insert(jobs), rows)
    finally:
        engine.dispose()


class Statements:
    """Counts the statements an engine sends."""

    def __init__(self, engine: Engine):
        self.n = 0
        event.listen(engine, "before_cursor_execute", self._count)

    def _count(self, *_args) -> None:
        self.n += 1


class Bench:
    """One worker's view of one fresh database: its look at the queue and its claim, as worker/supervisor/main.py
    makes them."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.slot = placement.Slot(WORKER)
        self.look = idle_look.Look() if idle_look else None
        workers.register_worker(engine, WORKER, "bench-host", 1, "cpu", {}, "idle")
        self.statements = Statements(engine)

    def poll(self, woken: bool = False) -> bool:
        if self.look is None:  # the code before issue 40: no memory between looks
            return queue.has_work(self.engine, "cpu", {}, WORKER, self.slot, 15.0)
        return queue.has_work(self.engine, "cpu", {}, WORKER, self.slot, 15.0, look=self.look, woken=woken)

    def cycle(self) -> int:
        """A wake-up's look, then the claim; the claimed job is ended at once (outside the measurement)."""
        assert self.poll(woken=True)
        if self.look is None:
            job = queue.claim(self.engine, WORKER, "cpu", 15.0, {}, self.slot)
        else:
            job = queue.claim(self.engine, WORKER, "cpu", 15.0, {}, self.slot, look=self.look)
        assert job is not None
        return job.id


def measure(fn: Callable[[], object], prepare: Callable[[], object], statements: Statements,
            rounds: int) -> tuple[float, int]:
    """Median CPU ms of fn over rounds (prepare before each, not counted), and the statements of its last call."""
    spent = []
    for _ in range(rounds):
        prepare()
        n0, t0 = statements.n, time.process_time()
        fn()
        spent.append(1000 * (time.process_time() - t0))
        sent = statements.n - n0
    return statistics.median(spent), sent


def queue_job(engine: Engine, project_id: int | None) -> None:
    job = enqueue(engine, parse_spec(TINY_JOB))[0]
    if project_id is not None:
        with write(engine) as conn:
            conn.execute(update(jobs).where(jobs.c.id == job.id).values(project_id=project_id))


def end_running(engine: Engine) -> None:
    with write(engine) as conn:
        conn.execute(update(jobs).where(jobs.c.state == "running").values(
            state="succeeded", finished_at=db_now(), lease_expires_at=None))


def refill(engine: Engine, *project_ids: int | None) -> None:
    """Before a claim cycle: the last one's job ended, one job of each project queued."""
    end_running(engine)
    for p in project_ids:
        queue_job(engine, p)


def profile_one(url: str, history: bool, rounds: int, lines: int) -> dict[str, tuple[float, int]]:
    engine = make_engine(url)
    migrate.upgrade(engine)
    if history:
        build_history(url)
    b = Bench(engine)
    out = {}
    b.poll()  # the first look after start: a full one
    out["idle poll"] = measure(b.poll, lambda: None, b.statements, rounds)
    out["claim cycle, 1 project"] = measure(b.cycle, lambda: refill(engine, None), b.statements, max(10, rounds // 5))
    end_running(engine)
    with engine.connect() as conn:
        two = [r for (r,) in conn.execute(select(projects.c.id).order_by(projects.c.id).limit(2))]
    while len(two) < 2:
        with write(engine) as conn:
            two.append(conn.execute(insert(projects).values(name=f"two-{len(two)}", share=1.0, limits={},
                                                            created_at=0.0).returning(projects.c.id)).scalar_one())
    for k in range(3):
        queue_job(engine, two[k % 2])
    out["claim cycle, 2 projects"] = measure(b.cycle, lambda: refill(engine, *two), b.statements,
                                             max(10, rounds // 5))
    if lines and history:
        end_running(engine)
        print(f"\n{engine.dialect.name}, with history: the costliest functions")
        for name, fn, prep in (("idle poll", b.poll, lambda: None),
                               ("claim cycle, 2 projects", b.cycle,
                                lambda: refill(engine, two[0])),):
            prof = cProfile.Profile()
            for _ in range(10):
                prep()
                prof.enable()
                fn()
                prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(lines)
            print(f"--- {name}, 10 calls ---\n" + "\n".join(
                ln for ln in text.getvalue().splitlines() if ln.strip() and "{" not in ln[:8]))
    engine.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=100, help="idle polls measured (claims: a fifth, at least 10)")
    ap.add_argument("--lines", type=int, default=0, help="print the N costliest functions with history")
    args = ap.parse_args()
    backends = {"sqlite": ["SQLite"], "postgres": ["PostgreSQL"], "both": ["SQLite", "PostgreSQL"]}[args.backend]
    res = {}
    for b in backends:
        for history in (False, True):
            with (postgres_schema("claimcost") if b == "PostgreSQL" else nullcontext("")) as url, \
                    tempfile.TemporaryDirectory() as tmp:
                res[(b, history)] = profile_one(url or f"sqlite:///{Path(tmp) / 'q.db'}", history,
                                                args.rounds, args.lines)
    cols = [(b, h) for b in backends for h in (False, True)]
    names = list(next(iter(res.values())))
    rows = [[name, *[f"{res[c][name][0]:.2f} ms, {res[c][name][1]} st" for c in cols]] for name in names]
    print("\nCPU time of this process per call (median) and statements sent ('st'):")
    print(table(["", *[f"{b}{', history' if h else ''}" for b, h in cols]], rows))


if __name__ == "__main__":
    main()
