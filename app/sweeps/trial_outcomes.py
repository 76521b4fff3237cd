"""Telling a sweep's study what one of its trial jobs did since the last pass: each new epoch's metric, a
pruning decision on a running job (the job ended `pruned` through the queue, its worker fenced out), and how
the job ended."""
import logging

import optuna
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import select
from sqlalchemy.engine import Engine

from trainyard.app.core.states import Failure, JobState, error_record
from trainyard.app.db import metrics, read
from trainyard.app.jobs import queue
from trainyard.app.records import Job
from trainyard.app.records.sweep_results import trial_value
from trainyard.app.spec import SweepSpec

log = logging.getLogger("trainyard.sweeps")


def follow(engine: Engine, spec: SweepSpec, study: optuna.Study, frozen: FrozenTrial, job: Job) -> bool:
    """Tell the study what the trial's job did since the last pass (the median rule compares a trial with the
    finished trials' epochs: every epoch is told); True when it ended as a failure max_failed_trials counts."""
    if spec.pruner is not None and job.started_at is not None and prune(engine, spec, study, frozen, job):
        return False
    final = trial_value(job, spec.metric) if job.state == JobState.SUCCEEDED else None
    if final is not None:
        study.tell(frozen.number, final)
    elif job.state == JobState.PRUNED:
        study.tell(frozen.number, state=TrialState.PRUNED)
    elif job.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        study.tell(frozen.number, state=TrialState.FAIL)
        return counts_as_failed(job)
    return False


def prune(engine: Engine, spec: SweepSpec, study: optuna.Study, frozen: FrozenTrial, job: Job) -> bool:
    """Report the job's new epochs (of an ended job too) and, if the pruner says so at one of them and the job
    still runs, end it as pruned; True when it was. A job's epochs run ahead of the passes (Iris runs forty in a
    quarter second, and telling the study an epoch is a write): the job is pruned at the epoch it has reached
    when the decision is carried out, read and ended in one guarded write (queue.prune), and what it says
    names both, so its metrics end at the epoch it says. A job that has reported its last epoch is left to
    finish."""
    trial = optuna.Trial(study, frozen._trial_id)
    decided: tuple[int, float] | None = None
    last = max(frozen.intermediate_values, default=0)
    for epoch, value in reports(engine, job.id, spec.metric, last):
        trial.report(value, epoch)
        last = epoch
        # Asked on every epoch until it decides: ASHA notes each trial's value at each rung then.
        if decided is None and trial.should_prune():
            decided = (epoch, value)
    if decided is None or job.state != JobState.RUNNING:
        return False
    judged, value = decided
    at = queue.prune(engine, job.id, lambda at: error_record(Failure.PRUNED, "Pruned",
                                                             prune_reason(spec, at, judged, value)))
    if at is None:
        return False
    for epoch, later in reports(engine, job.id, spec.metric, last):  # the epochs it ran before it was caught
        trial.report(later, epoch)
    study.tell(frozen.number, state=TrialState.PRUNED)
    log.info("sweep %s: trial %s (job %s) pruned at epoch %s", job.sweep_id, frozen.number, job.id, at)
    return True


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


def prune_reason(spec: SweepSpec, at: int, epoch: int, value: float) -> str:
    """Why a trial was pruned at epoch `at`: its metric at `epoch` (the first the pruner judged poor: `at`, or
    an earlier one its job had run past by the time the decision was carried out)."""
    assert spec.pruner is not None
    rule = "worse than the median of the earlier trials at that epoch (median rule)" if spec.pruner.type == "median" \
        else f"outside the best 1/{spec.pruner.reduction_factor} of the trials that reached that epoch (ASHA)"
    seen = "" if epoch == at else f" at epoch {epoch}"
    return f"pruned at epoch {at}: {spec.metric} {value:.4g}{seen} is {rule}"
