"""Retention: which ended jobs keep their checkpoints, files and rows, as the settings say (docs/configuration.md).

Each rule is a guarded UPDATE or DELETE on the jobs' rows; none touches an object. An object goes when no row
refers to it any more: the collector (app/lifecycle/collector.py) lists the store after these rules and removes what
nothing references. So a rule and the job it acts on never race over a file: a retry, a claim or a pin that
commits first makes the rule's guard match nothing; one that comes after finds the rows as the rule left them
(a retried job whose checkpoint was dropped starts over).

- A succeeded job's checkpoints are not needed (its worker deletes them as it ends): its checkpoint_path goes.
- A failed, cancelled or pruned job's checkpoint is kept checkpoint_ttl_s after it ended, for a retry to resume.
- Failed, cancelled and pruned jobs that are no sweep's trials go (rows, then files) ended_job_ttl_s after they
  ended, unless something keeps them (app/lifecycle/references.py: pinned, named by a job still to run).
- Once a sweep has ended, its trials outside the best k (its spec's keep_best, else sweep_keep_best) lose their
  files: artifact_path and checkpoint are set NULL and `reclaimed` says why; the rows stay, as the sweep's record
  (its trial table, curves and counts), until the sweep is deleted.
- Logs and exports have no rows: app/lifecycle/collector.py's referenced set leaves them out once older than their TTL.
A TTL of 0 keeps for ever.
"""
from dataclasses import dataclass

from sqlalchemy import false, func, or_, select, update
from sqlalchemy.engine import Engine

from trainyard.app.core.settings import Settings
from trainyard.app.core.states import JobState, SweepState
from trainyard.app.db import jobs, read, sweeps, write
from trainyard.app.lifecycle import deletion, references
from trainyard.app.records import sweep_reads
from trainyard.app.records.sweep_results import best_trials

UNSUCCESSFUL = (JobState.FAILED.value, JobState.CANCELLED.value, JobState.PRUNED.value)
NOT_PINNED = func.coalesce(jobs.c.pinned, false()) == false()
# A trial whose files retention has not reclaimed (or that made new ones since: a retried trial).
HOLDING = or_(jobs.c.reclaimed.is_(None), jobs.c.artifact_path.is_not(None), jobs.c.checkpoint_path.is_not(None))


@dataclass(frozen=True)
class Rules:
    checkpoint_ttl_s: float
    ended_job_ttl_s: float
    sweep_keep_best: int
    log_ttl_s: float
    export_ttl_s: float

    @classmethod
    def of(cls, settings: Settings) -> "Rules":
        return cls(settings.checkpoint_ttl_s, settings.ended_job_ttl_s, settings.sweep_keep_best,
                   settings.log_ttl_s, settings.export_ttl_s)


@dataclass
class Applied:
    """What one pass of the rules changed."""
    checkpoints_dropped: int = 0
    jobs_deleted: int = 0
    trials_reclaimed: int = 0


def apply(engine: Engine, rules: Rules, now: float) -> Applied:
    """Apply every rule once, as of `now` (the database's clock, as jobs' finished_at is)."""
    done = Applied()
    done.checkpoints_dropped = drop_checkpoints(engine, rules, now)
    if rules.ended_job_ttl_s:
        done.jobs_deleted = delete_expired(engine, now - rules.ended_job_ttl_s)
    done.trials_reclaimed = reclaim_trials(engine, rules.sweep_keep_best, now)
    return done


def drop_checkpoints(engine: Engine, rules: Rules, now: float) -> int:
    with write(engine) as conn:
        dropped = conn.execute(update(jobs).where(jobs.c.state == JobState.SUCCEEDED.value,
                                                  jobs.c.checkpoint_path.is_not(None))
                               .values(checkpoint_path=None)).rowcount
        if rules.checkpoint_ttl_s:
            # With the epoch too: a retry then starts from epoch 1 and drops the earlier runs' metrics.
            dropped += conn.execute(update(jobs).where(
                jobs.c.state.in_(UNSUCCESSFUL), jobs.c.checkpoint_path.is_not(None), NOT_PINNED,
                jobs.c.finished_at < now - rules.checkpoint_ttl_s)
                .values(checkpoint_path=None, checkpoint_epoch=None)).rowcount
    return dropped


def delete_expired(engine: Engine, ended_before: float) -> int:
    with read(engine) as conn:
        ids = list(conn.execute(select(jobs.c.id).where(
            jobs.c.state.in_(UNSUCCESSFUL), jobs.c.sweep_id.is_(None), NOT_PINNED,
            jobs.c.finished_at < ended_before).order_by(jobs.c.id)).scalars())
    deleted = 0
    for i in range(0, len(ids), deletion.CHUNK):
        deleted += len(deletion.delete_unkept(engine, ids[i:i + deletion.CHUNK]))
    return deleted


def reclaim_trials(engine: Engine, default_k: int, now: float) -> int:
    """Reclaim the files of ended sweeps' trials outside their best k; how many trials were."""
    unreclaimed = (select(jobs.c.sweep_id, func.count().label("n")).where(jobs.c.sweep_id.is_not(None), HOLDING)
                   .group_by(jobs.c.sweep_id).subquery())
    with read(engine) as conn:
        candidates = conn.execute(
            select(sweeps.c.id, unreclaimed.c.n, sweeps.c.spec["keep_best"].as_integer().label("keep_best"),
                   sweeps.c.spec["metric"].as_string().label("metric"),
                   sweeps.c.spec["direction"].as_string().label("direction"))
            .join(unreclaimed, unreclaimed.c.sweep_id == sweeps.c.id)
            .where(sweeps.c.state != SweepState.RUNNING.value)).all()
    reclaimed = 0
    for sweep in candidates:
        k = default_k if sweep.keep_best is None else sweep.keep_best
        if k and sweep.n > k:  # only sweeps with more than k trials still holding files are read
            reclaimed += _reclaim_sweep(engine, sweep, k, now)
    return reclaimed


def _reclaim_sweep(engine: Engine, sweep, k: int, now: float) -> int:
    with write(engine) as conn:
        trials = sweep_reads.trials_in(conn, [sweep.id])[sweep.id]
        best = {j.id for j in best_trials({"metric": sweep.metric, "direction": sweep.direction}, trials, k)}
        doomed = [t.id for t in trials if t.id not in best and (t.reclaimed is None or t.artifact_path
                                                                 or t.checkpoint_path)]
        doomed = [i for i in deletion.lock(conn, doomed) if references.why_kept(conn, i) is None]
        if not doomed:
            return 0
        why = f"not among sweep {sweep.id}'s best {k} trials (keep_best)"
        return conn.execute(update(jobs).where(
            jobs.c.id.in_(doomed), jobs.c.state.not_in(references.ACTIVE), NOT_PINNED, HOLDING)
            .values(artifact_path=None, checkpoint_path=None, checkpoint_epoch=None,
                    reclaimed={"at": now, "why": why})).rowcount
