"""`trainyard slurm-agent`: one Slurm allocation per job that runs on Slurm, its workers bound to that job.

trainyard keeps its queue, records, fencing, leases and workers; Slurm decides where and when. Each pass:
squeue once (every trainyard allocation, ended ones too), then
- follow each live allocation (slurm_allocations without ended_at): its state, reason and nodes into the row and
  the job's record (jobs.slurm, shown in waiting_for, the API and the dashboard), a log line when it starts;
  scancel one whose job ended (cancelled in trainyard) while it still runs;
- end each allocation Slurm has ended (or forgotten): the row first, so its workers take nothing more
  (app/fleet/placement.py), then the run it served, fenced by the job's claim, as ENDINGS says (app/clusters/slurm.py):
  a time limit fails it `timeout`, an outside scancel cancels it, a preemption requeues it without an attempt, a
  lost node or failed allocation fails it `infrastructure` (retried from its last checkpoint while attempts
  remain);
- ask for an allocation (sbatch) for each queued job on Slurm whose dependencies are met and that has none live;
  after TRAINYARD_SLURM_MAX_ASKS allocations that ended before the job started, the job fails, saying why.
Inside an allocation, `srun` starts `trainyard worker --for-job ID` on every node, one per device: they claim
that job alone and leave once it ends. Torch-free.
"""
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from sqlalchemy import exists, func, insert, select, update
from sqlalchemy.engine import Row

from trainyard.app.clusters import slurm
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import Failure, JobState, error_record
from trainyard.app.db import db_now, jobs, make_engine, migrate, projects, read, write
from trainyard.app.db.tables import slurm_allocations as allocs
from trainyard.app.fleet import dependencies
from trainyard.app.jobs import queue

log = logging.getLogger("trainyard.slurm")
QUEUED, RUNNING = JobState.QUEUED.value, JobState.RUNNING.value
# A job that ended in trainyard whose allocation still runs this long after (its workers leave by themselves once
# it ends: a success, a failure) is scancelled; a cancelled one at once.
LINGER_S = 30.0
# Settings a worker never needs, which the agent's environment may hold: not handed to the allocations.
SERVER_SECRETS = frozenset({"TRAINYARD_API_TOKEN", "TRAINYARD_MLFLOW_PASSWORD", "TRAINYARD_MLFLOW_TOKEN",
                            "TRAINYARD_MLFLOW_USERNAME"})


class Agent:
    def __init__(self, settings: Settings, slurm_env: dict[str, str] | None = None):
        self.settings = settings
        self.engine = make_engine(settings.db_url)
        self.options = slurm.operator_options(settings.slurm_sbatch_options)  # refused at start, not per job
        if not settings.slurm_partition:
            raise slurm.Refused("TRAINYARD_SLURM_PARTITION is not set: no partition to ask allocations of")
        slurm.name(settings.slurm_partition, "TRAINYARD_SLURM_PARTITION")
        # Slurm's commands run with this environment, which sbatch hands the allocation's workers (--export=ALL):
        # the database as the nodes reach it, the data directory they share.
        # The server's own secrets stay here: a job's code runs with its worker's environment.
        own = {k: v for k, v in os.environ.items() if k not in SERVER_SECRETS}
        self.env = {**own, **(slurm_env or {}), "TRAINYARD_DATA_DIR": str(settings.data_dir.resolve()),
                    "TRAINYARD_DATABASE_URL": settings.slurm_database_url or settings.db_url}
        self.out_dir = settings.data_dir.resolve() / "slurm"
        self.stopping = False

    def run(self) -> int:
        migrate.prepare(self.engine)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        log.info("slurm agent on partition %s, every %.1f s", self.settings.slurm_partition, self.settings.slurm_poll_s)
        while not self.stopping:
            try:
                self.pass_once()
            except slurm.SlurmError as exc:
                log.warning("slurm: %s", exc)
            time.sleep(self.settings.slurm_poll_s)
        self.engine.dispose()
        return 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def pass_once(self) -> None:
        seen = slurm.squeue(self.env)
        for row in self._live():
            got = seen.get(row.slurm_id or "")
            state = got.state if got else "GONE"
            if got is None or state in slurm.FINAL:
                self.end(row, state)
            else:
                self.follow(row, got)
        for job in self._to_ask():
            self.ask(job)

    # -- live allocations --------------------------------------------------------------------------------------

    def _live(self) -> Sequence[Row]:
        with read(self.engine) as conn:
            return conn.execute(select(allocs, jobs.c.state.label("job_state"), jobs.c.claim.label("job_claim"),
                                       jobs.c.finished_at, db_now().label("now"))
                                .join(jobs, jobs.c.id == allocs.c.job_id).where(allocs.c.ended_at.is_(None))
                                .order_by(allocs.c.id)).all()

    def follow(self, row: Row, got: slurm.Seen) -> None:
        """A live allocation: record what Slurm says of it; scancel it when its job has ended here."""
        if row.job_state not in (QUEUED, RUNNING) and (
                row.job_state == JobState.CANCELLED.value or row.now - (row.finished_at or row.now) > LINGER_S):
            if row.outcome is None:
                slurm.scancel(got.slurm_id, self.env)
                self._set(row, outcome=f"scancelled: the job is {row.job_state}")
                log.info("job %s is %s: scancel %s", row.job_id, row.job_state, got.slurm_id)
            return
        values: dict[str, Any] = dict(state=got.state, reason=got.reason, nodes=got.nodes, partition=got.partition)
        if got.state == RUNNING.upper() and row.started_at is None:
            values["started_at"] = db_now()
            self.note(row.job_id, f"slurm: allocation {got.slurm_id} started on {got.nodes}")
        if row.job_state == RUNNING and row.claim is None and got.state == RUNNING.upper():
            values["claim"] = row.job_claim  # the run this allocation's workers took
        if any(getattr(row, k) != v for k, v in values.items() if k != "started_at") or "started_at" in values:
            self._set(row, **values)

    def end(self, row: Row, state: str) -> None:
        """An allocation Slurm ended: mark it ended (its workers then take nothing more), then end the run it served
        as its state says, fenced by that run's claim."""
        ending = slurm.ENDINGS.get(state, slurm.ENDINGS["GONE"])
        why = f"Slurm job {row.slurm_id} {ending.why}"
        self._set(row, state=state, ended_at=db_now())
        with read(self.engine) as conn:
            job = conn.execute(select(jobs.c.state, jobs.c.claim).where(jobs.c.id == row.job_id)).first()
        if job is None or job.state not in (QUEUED, RUNNING):
            outcome = "the job had ended"
        elif ending.final is not None and ending.cls is not None and (job.state == RUNNING or row.claim is not None
                                                                     or state == "CANCELLED"):
            error = error_record(ending.cls, f"Slurm{state.title().replace('_', '')}", why)
            ended = queue.stop(self.engine, [row.job_id], error, final=ending.final)
            outcome = f"job {ending.final}: {why}" if ended else "the job had ended"
        elif job.state == RUNNING and ending.cls is None:
            outcome = "run requeued (preempted)" if queue.requeue_preempted(self.engine, row.job_id, job.claim) \
                else "the run had ended"
        elif job.state == RUNNING and ending.cls is not None:
            new = queue.fail(self.engine, row.job_id, job.claim, error_record(ending.cls, "SlurmAllocationLost", why))
            outcome = f"run failed ({ending.cls.value}), job {new}" if new else "the run had ended"
        else:
            outcome = "ended before the job started: asked again" if row.claim is None else "the run had ended"
        self._set(row, outcome=outcome[:500])
        self.note(row.job_id, f"slurm: allocation {row.slurm_id} ended {state}: {outcome}")
        log.info("job %s: allocation %s ended %s: %s", row.job_id, row.slurm_id, state, outcome)

    def _set(self, row: Row, **values: Any) -> None:
        with write(self.engine) as conn:
            conn.execute(update(allocs).where(allocs.c.id == row.id).values(**values))
            got = conn.execute(select(allocs).where(allocs.c.id == row.id)).one()
            record = {"id": got.slurm_id, "partition": got.partition, "nodes": got.nodes, "state": got.state,
                      "reason": got.reason}
            conn.execute(update(jobs).where(jobs.c.id == row.job_id).values(slurm=record))

    # -- asking ------------------------------------------------------------------------------------------------

    def _to_ask(self) -> Sequence[Row]:
        live = exists().where(allocs.c.job_id == jobs.c.id, allocs.c.ended_at.is_(None))
        unstarted = (select(func.count()).where(allocs.c.job_id == jobs.c.id, allocs.c.claim.is_(None),
                                                allocs.c.ended_at.is_not(None)).scalar_subquery())
        with read(self.engine) as conn:
            return conn.execute(select(jobs.c.id, jobs.c.devices, jobs.c.hosts, jobs.c.device_req, jobs.c.spec,
                                       projects.c.name.label("project"), unstarted.label("unstarted"))
                                .outerjoin(projects, projects.c.id == jobs.c.project_id)
                                .where(jobs.c.state == QUEUED, jobs.c.runs_on == "slurm", ~live,
                                       dependencies.ready()).order_by(jobs.c.priority.desc(), jobs.c.id)).all()

    def ask(self, job: Row) -> None:
        """sbatch for one queued job (or, past the bound, fail it)."""
        if job.unstarted >= self.settings.slurm_max_asks:
            with read(self.engine) as conn:
                last = conn.execute(select(allocs.c.slurm_id, allocs.c.state, allocs.c.outcome).where(
                    allocs.c.job_id == job.id).order_by(allocs.c.id.desc()).limit(1)).first()
            said = f"; the last, Slurm job {last.slurm_id}, {last.state}: {last.outcome}" if last else ""
            error = error_record(Failure.INFRASTRUCTURE, "SlurmAllocationsLost",
                                 f"{job.unstarted} Slurm allocations ended before the job started "
                                 f"(TRAINYARD_SLURM_MAX_ASKS){said}; their output: {self.out_dir}")
            queue.stop(self.engine, [job.id], error, states=(QUEUED,), final=JobState.FAILED.value)
            return
        try:
            ask = self.ask_for(job)
            slurm_id, state, outcome = slurm.submit(ask, self.out_dir, self.env), "PENDING", None
        except (slurm.Refused, slurm.SlurmError) as exc:
            ask, slurm_id, state, outcome = None, None, "REFUSED", str(exc)[:500]
        with write(self.engine) as conn:
            values = dict(job_id=job.id, slurm_id=slurm_id, partition=ask.partition if ask else None, state=state,
                          asked_at=db_now(), ended_at=db_now() if outcome else None, outcome=outcome)
            conn.execute(insert(allocs).values(**values))
            conn.execute(update(jobs).where(jobs.c.id == job.id).values(slurm={
                "id": slurm_id, "partition": values["partition"], "nodes": None, "state": state, "reason": outcome}))
        if ask is not None:
            self.note(job.id, f"slurm: asked for allocation {slurm_id} (partition {ask.partition}, {ask.nodes} "
                              f"node(s) x {ask.tasks_per_node} task(s))")
        else:
            self.note(job.id, f"slurm: sbatch refused: {outcome}")
        log.info("job %s: %s", job.id, f"asked for allocation {slurm_id}" if ask else f"sbatch refused: {outcome}")

    def ask_for(self, job: Row) -> slurm.Ask:
        """The allocation a job needs: a node per host, a task per device on each; its own partition, account, QOS
        and time limit (spec.slurm) over its project's (TRAINYARD_SLURM_PROJECTS) over the service's."""
        s = self.settings
        own = {k: v for k, v in ((job.spec or {}).get("slurm") or {}).items() if v is not None}
        project = {k: v for k, v in (s.slurm_projects.get(job.project or "") or {}).items() if v is not None}
        pick = {"partition": s.slurm_partition, "account": s.slurm_account, "qos": s.slurm_qos,
                "time_limit_min": s.slurm_time_limit_min, **project, **own}
        hosts = job.hosts or 1
        per_node = (job.devices or 1) // hosts
        gpus = per_node if job.device_req.startswith("cuda") else 0
        return slurm.Ask(job_id=job.id, nodes=hosts, tasks_per_node=per_node, partition=pick["partition"],
                         cpus_per_task=s.slurm_cpus_per_rank, gpus_per_node=gpus,
                         mem_mb=s.slurm_mem_mb_per_rank * per_node if s.slurm_mem_mb_per_rank else None,
                         time_limit_min=pick["time_limit_min"], account=pick["account"], qos=pick["qos"],
                         options=self.options)

    def note(self, job_id: int, text: str) -> None:
        """A line in the job's log (its supervisor's file, appended whole: lines of its own between runs)."""
        path: Path = self.settings.layout.log(job_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        except OSError as exc:
            log.warning("job %s: log line not written: %s", job_id, exc)


def main(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return Agent(settings).run()
    except (slurm.Refused, migrate.SchemaBehind) as exc:
        raise SystemExit(f"trainyard slurm-agent: {exc}") from None

