"""The MLflow sender: brings each pending tracked_runs row's run up to date with its job's (or sweep's) records.

One pass (`Sender.run_pass`, every PASS_S in the host's housekeeper process) takes the rows with something to send
and holds them (mirror, mirror_until: one sender at a time, whichever host's server it is), then for each:

- makes the run once (a job's first claim, or a sweep's start), with its tags, the trial's parent (its sweep's
  run: the sweep's row is sent first) and, for a retry, the run it follows (`trainyard.retry_of`);
- sends the parameters (the spec, flattened) once;
- sends every epoch the job's records hold for good: while it runs, those up to its last checkpoint (a run that
  resumes starts after it, so no epoch sent is ever run again); once it ended, all of them. A point's timestamp
  is its record's, so a send repeated after a crash sends the same points, which MLflow keeps once;
- at the end: the result's numbers (final/<name>), the model's files as run artifacts and a registered version
  where the spec asks, the last tags (worker, device, error), and the status (fields.STATUS).

What reaches MLflow is what the jobs table holds, and that only the fenced writes of a job's current claim put
there: two claims of one job never both reach the tracker. A send that fails (the tracker down or slow past
TRAINYARD_MLFLOW_TIMEOUT_S) leaves the row pending with its error, sent again later, backing off; the backlog is
the pending rows (trainyard_tracking_backlog_runs in /metrics), bounded by the jobs retention keeps.
"""
import logging
import os
import secrets
from typing import Any

from sqlalchemy import and_, exists, func, or_, select, update
from sqlalchemy.engine import Engine, Row

from trainyard.app.core.settings import Settings
from trainyard.app.core.states import TERMINAL, JobState, SweepState
from trainyard.app.db import counting, db_now, jobs, metrics, projects, read, sweeps, tracked_runs, write
from trainyard.app.records import sweep_reads, sweep_results
from trainyard.app.tracking import fields
from trainyard.app.tracking.mlflow_calls import Mlflow, credentials

log = logging.getLogger("trainyard.tracking")
# How often the sender looks for rows to send; how long it holds those it took; how many rows one pass takes.
PASS_S = 1.0
HOLD_S = 120.0
TAKE = 50
ENDED_STATES = tuple(s.value for s in TERMINAL)
TRACKED_KINDS_WITH_MODELS = ("train", "run")
# A row whose run holds everything: no error, and no sender holds it.
SETTLED = dict(error=None, failures=0, retry_at=None, mirror=None, mirror_until=None)


class Sender:
    """Sends tracked jobs and sweeps to one MLflow tracking server (settings.mlflow_tracking_uri)."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.mlflow = Mlflow(settings)
        self.secrets = credentials(settings)
        self.me = f"{settings.node}-{os.getpid()}-{secrets.token_hex(3)}"

    # ---- the pass ------------------------------------------------------------------------------------------

    def run_pass(self) -> int:
        """Send what is due; the number of rows that went without an error."""
        sent: list[Row] = []
        for row in self._take():
            try:
                if row.sweep_id is not None:
                    self._send_sweep(row)
                else:
                    self._send_job(row)
            except Exception as exc:  # the tracker's error, whatever its type: kept, and sent again later
                self._failed(row, exc)
            else:
                sent.append(row)
        if sent:  # one transaction for the pass's sends: a row that had failed loses its error
            recovered = [r for r in sent if r.failures]
            with write(self.engine) as conn:
                if recovered:
                    conn.execute(update(tracked_runs).where(self._mine(*recovered))
                                 .values(error=None, failures=0, retry_at=None))
                counting.add(conn, counting.tracker(True, len(sent)))
        return len(sent)

    def _take(self) -> list[Row]:
        """The rows with something to send, held for this sender: sweeps first (a trial's run needs its parent)."""
        t = tracked_runs.c
        due = and_(t.pending, or_(t.retry_at.is_(None), t.retry_at <= db_now()),
                   or_(t.mirror_until.is_(None), t.mirror_until < db_now(), t.mirror == self.me))
        job_has_news = exists().where(jobs.c.id == t.job_id, or_(
            jobs.c.state.in_(ENDED_STATES),
            and_(jobs.c.claim > 0, or_(t.run_id.is_(None), t.status.in_(fields.ENDED),
                                       func.coalesce(jobs.c.checkpoint_epoch, 0) > t.sent_epoch))))
        sweep_has_news = exists().where(sweeps.c.id == t.sweep_id, or_(
            t.run_id.is_(None), sweeps.c.state != SweepState.RUNNING.value))
        with write(self.engine) as conn:
            ids = (select(t.id).where(due, or_(job_has_news, sweep_has_news))
                   .order_by(t.sweep_id.is_(None), t.id).limit(TAKE).scalar_subquery())
            taken = conn.execute(update(tracked_runs).where(t.id.in_(ids), due)
                                 .values(mirror=self.me, mirror_until=db_now() + HOLD_S).returning(tracked_runs)).all()
        return sorted(taken, key=lambda r: (r.sweep_id is None, r.id))

    def _mine(self, *rows: Row) -> Any:
        """The rows, while this sender still holds them."""
        return and_(tracked_runs.c.id.in_([r.id for r in rows]), tracked_runs.c.mirror == self.me)

    def _save(self, row: Row, **values: Any) -> bool:
        with write(self.engine) as conn:
            return conn.execute(update(tracked_runs).where(self._mine(row)).values(**values)).rowcount == 1

    def _failed(self, row: Row, exc: BaseException) -> None:
        what = f"job {row.job_id}" if row.job_id is not None else f"sweep {row.sweep_id}"
        # Shown to whoever sees the job (GET /jobs/{id}): never the tracker's credentials, which an error may quote.
        message = fields.redact(f"{type(exc).__name__}: {exc}", self.secrets)[:1000]
        log.warning("MLflow: %s not sent (%s); sent again later", what, message)
        wait = min(self.settings.mlflow_retry_max_s, 2.0 ** min(row.failures + 1, 16))
        with write(self.engine) as conn:
            conn.execute(update(tracked_runs).where(self._mine(row)).values(
                error=message, failures=tracked_runs.c.failures + 1, retry_at=db_now() + wait,
                mirror=None, mirror_until=None))
            counting.add(conn, counting.tracker(False))

    # ---- a job ---------------------------------------------------------------------------------------------

    def _send_job(self, row: Row) -> None:
        with read(self.engine) as conn:
            found = conn.execute(select(jobs).where(jobs.c.id == row.job_id)).first()
            if found is None:
                return  # deleted meanwhile: its row goes with it
            job = found._asdict()
            project = self._project(conn, job["project_id"])
            parent = conn.execute(select(tracked_runs.c.run_id).where(tracked_runs.c.sweep_id == job["sweep_id"])
                                  ).first() if job["sweep_id"] is not None else None
        state = JobState(job["state"])
        ended = state in TERMINAL
        if row.status in fields.ENDED:
            if ended and job["claim"] == row.ended_claim:
                self._settle(row, job, row.status)  # nothing new (woken by a retry that was undone)
                return
            # Retried: the earlier run stays as it ended; this claim's history is a new run that names it.
            earlier = [*(row.earlier_runs or []), row.run_id]
            if not self._save(row, earlier_runs=earlier, run_id=None, sent_params=False, sent_epoch=0, status=None,
                              ended_claim=None, model_version=None):
                return
            row = self._reread(row)
        if row.run_id is None:
            if parent is not None and parent.run_id is None:
                return  # its sweep's run is not made yet: the sweep's row goes first, next pass
            tags = fields.job_tags(job, self.settings.url, project)
            if parent is not None:
                tags["mlflow.parentRunId"] = parent.run_id
            if row.earlier_runs:
                tags["trainyard.retry_of"] = row.earlier_runs[-1]
            experiment = fields.experiment_name(self.settings.mlflow_experiment, job["spec"], project)
            if not self._make_run(row, experiment, job["started_at"] or job["created_at"], tags):
                return
            row = self._reread(row)
        if not row.sent_params:
            self.mlflow.log(row.run_id, params=fields.flatten(job["spec"]))
            self._save(row, sent_params=True)
        self._send_epochs(row, job, ended)
        if ended:
            self._end_job(row, job, state, project)
        elif row.status is None and state == JobState.RUNNING:
            self._save(row, status="RUNNING")

    def _send_epochs(self, row: Row, job: dict[str, Any], ended: bool) -> None:
        """The epochs held for good: while the job runs, those its last checkpoint covers (a resumed run starts
        after it); once it ended, all of them."""
        with read(self.engine) as conn:
            query = select(metrics.c.epoch, metrics.c.data, metrics.c.created_at).where(
                metrics.c.job_id == job["id"], metrics.c.epoch > row.sent_epoch)
            if not ended:
                query = query.where(metrics.c.epoch <= (job["checkpoint_epoch"] or 0))
            epochs = [(e, d, at) for e, d, at in conn.execute(query.order_by(metrics.c.epoch)).all()]
        if epochs:
            self.mlflow.log(row.run_id, points=list(fields.points(epochs)))
            self._save(row, sent_epoch=epochs[-1][0])

    def _end_job(self, row: Row, job: dict[str, Any], state: JobState, project: str | None) -> None:
        """The result's numbers, the last tags, the model (and its registered version), then the status."""
        finished_ms = int((job["finished_at"] or job["created_at"]) * 1000)
        step = job["epoch"] or 0
        self.mlflow.log(row.run_id, points=[(k, v, finished_ms, step) for k, v in fields.finals(job["result"]).items()],
                        tags=fields.job_tags(job, self.settings.url, project))
        if state == JobState.SUCCEEDED and job["kind"] in TRACKED_KINDS_WITH_MODELS and job["artifact_path"]:
            self.mlflow.log_model(row.run_id, self.settings.store, job["artifact_path"])
            name = (job["spec"].get("tracking") or {}).get("register_model")
            if name and row.model_version is None:
                self._save(row, model_version=self.mlflow.register(name, row.run_id, job["id"]))
        status = fields.STATUS[state]
        self.mlflow.end(row.run_id, status, finished_ms)
        self._settle(row, job, status)

    def _settle(self, row: Row, job: dict[str, Any], status: str) -> None:
        """The run holds all the job's records: not pending, unless the job changed meanwhile (a retry)."""
        unchanged = exists().where(jobs.c.id == job["id"], jobs.c.state == job["state"], jobs.c.claim == job["claim"])
        with write(self.engine) as conn:
            conn.execute(update(tracked_runs).where(self._mine(row), unchanged).values(
                pending=False, status=status, ended_claim=job["claim"], **SETTLED))

    # ---- a sweep -------------------------------------------------------------------------------------------

    def _send_sweep(self, row: Row) -> None:
        with read(self.engine) as conn:
            found = conn.execute(select(sweeps).where(sweeps.c.id == row.sweep_id)).first()
            if found is None:
                return
            sweep = found._asdict()
            project = self._project(conn, sweep["project_id"])
        spec = sweep["spec"]
        goal = sweep_results.goal(spec)
        if row.run_id is None:
            experiment = fields.experiment_name(self.settings.mlflow_experiment, spec.get("job") or {}, project)
            if not self._make_run(row, experiment, sweep["created_at"],
                                  fields.sweep_tags(sweep, self.settings.url, project, goal)):
                return
            row = self._reread(row)
        run_id = row.run_id
        if not row.sent_params:
            self.mlflow.log(run_id, params=fields.flatten({k: v for k, v in spec.items() if k != "name"}))
            self._save(row, sent_params=True)
        state = SweepState(sweep["state"])
        if state == SweepState.RUNNING:
            return
        trials = sweep_reads.trials(self.engine, [sweep["id"]]).get(sweep["id"], [])
        counts = sweep_results.counts(trials)
        finished_ms = int((sweep["finished_at"] or sweep["created_at"]) * 1000)
        points = [(fields.key(f"trials/{k}"), float(n), finished_ms, 0) for k, n in counts.items()]
        tags: dict[str, str] = {}
        best = sweep_results.best_trial(spec, trials)
        if best is not None:
            value = sweep_results.trial_value(best, spec["metric"])
            if value is not None:
                points.append((fields.key(f"best/{spec['metric']}"), value, finished_ms, 0))
            tags |= {"trainyard.best_job": str(best.id), "trainyard.best_trial": str(sweep_results.trial_number(best))}
        self.mlflow.log(run_id, points=points, tags=tags)
        status = fields.SWEEP_STATUS[state]
        self.mlflow.end(run_id, status, finished_ms)
        with write(self.engine) as conn:
            conn.execute(update(tracked_runs).where(self._mine(row)).values(
                pending=False, status=status, **SETTLED))

    # ---- MLflow ----------------------------------------------------------------------------------------------

    def _make_run(self, row: Row, experiment: str, started_at: float, tags: dict[str, str]) -> bool:
        """A new run, recorded as the row's unless another sender recorded one first (then this one is deleted)."""
        experiment_id, run_id = self.mlflow.new_run(experiment, started_at, tags)
        with write(self.engine) as conn:
            made = conn.execute(update(tracked_runs).where(self._mine(row), tracked_runs.c.run_id.is_(None))
                                .values(run_id=run_id, experiment_id=experiment_id)).rowcount == 1
        if not made:
            self.mlflow.delete(run_id)
        return made

    def _reread(self, row: Row) -> Row:
        with read(self.engine) as conn:
            return conn.execute(select(tracked_runs).where(tracked_runs.c.id == row.id)).one()

    @staticmethod
    def _project(conn: Any, project_id: int | None) -> str | None:
        if project_id is None:
            return None
        return conn.execute(select(projects.c.name).where(projects.c.id == project_id)).scalar()
