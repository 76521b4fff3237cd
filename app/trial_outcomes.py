"""Telling a sweep's study what one of its trial jobs did since the last pass: each new epoch's metric, a
pruning decision on a running job (the job stopped through the queue), and how the job ended."""
import logging

import optuna
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import select
from sqlalchemy.engine import Engine

from trainyard.app import queue
from trainyard.app.db import metrics, read
from trainyard.app.records import Job
from trainyard.app.spec import SweepSpec
from trainyard.app.states import Failure, JobState, error_record
from trainyard.app.sweep_results import failure, trial_value

log = logging.getLogger("trainyard.sweeps")


def follow(engine: Engine, spec: SweepSpec, study: optuna.Study, frozen: FrozenTrial, job: Job) -> bool:
    """Tell the study what the trial's job did since the last pass (the median rule compares a trial with the
    finished trials' epochs: every epoch is told); True when it ended as a failure max_failed_trials counts."""
    if spec.pruner is not None and job.started_at is not None:
        trial = optuna.Trial(study, frozen._trial_id)
        for epoch, value in reports(engine, job.id, spec.metric, max(frozen.intermediate_values, default=0)):
            trial.report(value, epoch)
            # Asked on every epoch, of ended jobs too: ASHA notes each trial's value at each rung then.
            # A job that has reported its last epoch is only saving its model: let it finish.
            if trial.should_prune() and job.state == JobState.RUNNING and (job.epoch or 0) < (job.epochs or 0):
                why = error_record(Failure.PRUNED, "Pruned", prune_reason(spec, epoch, value))
                if queue.stop(engine, [job.id], why, states=(queue.RUNNING,), final=queue.FAILED):
                    study.tell(frozen.number, state=TrialState.PRUNED)
                    log.info("sweep %s: trial %s (job %s) pruned at epoch %s", job.sweep_id,
                             frozen.number, job.id, epoch)
                return False
    final = trial_value(job, spec.metric) if job.state == JobState.SUCCEEDED else None
    if final is not None:
        study.tell(frozen.number, final)
    elif job.state == JobState.FAILED and failure(job) == Failure.PRUNED:
        study.tell(frozen.number, state=TrialState.PRUNED)
    elif job.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        study.tell(frozen.number, state=TrialState.FAIL)
        return counts_as_failed(job)
    return False


def reports(engine: Engine, job_id: int, metric: str, after: int) -> list[tuple[int, float]]:
    """The job's metric at each epoch after `after`, in order."""
    with read(engine) as conn:
        rows = conn.execute(select(metrics.c.epoch, metrics.c.data).where(
            metrics.c.job_id == job_id, metrics.c.epoch > after).order_by(metrics.c.epoch)).all()
    return [(r.epoch, float(r.data[metric])) for r in rows
            if isinstance(r.data.get(metric), (int, float)) and not isinstance(r.data.get(metric), bool)]


def counts_as_failed(job: Job | None) -> bool:
    """A trial that failed counts against max_failed_trials unless its job was cancelled by hand (the
    user's choice, not a failure of the sweep)."""
    return getattr(job, "state", None) != JobState.CANCELLED


def prune_reason(spec: SweepSpec, epoch: int, value: float) -> str:
    assert spec.pruner is not None
    rule = "worse than the median of the earlier trials at that epoch (median rule)" if spec.pruner.type == "median" \
        else f"outside the best 1/{spec.pruner.reduction_factor} of the trials that reached that epoch (ASHA)"
    return f"pruned at epoch {epoch}: {spec.metric} {value:.4g} is {rule}"
