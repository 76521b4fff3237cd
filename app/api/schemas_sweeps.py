"""The wire types of sweeps (GET /sweeps, /sweeps/{id}, its trials and events) and the plain values the routes
serialise directly."""
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from trainyard.app.api.schemas import ts
from trainyard.app.core.states import JobState, SweepState
from trainyard.app.records import Job
from trainyard.app.records.sweep_results import best_trial, counts, failure, summary, trial_value


class TrialPublic(BaseModel):
    """A sweep's trial: its job, the values it tries, and its metric."""
    trial: int = Field(description="the trial's number in its sweep, from 0")
    job_id: int
    state: JobState = Field(description="its job's state")
    failure: str | None = Field(description="its job's error class when it failed or was pruned: job, oom..., pruned")
    params: dict[str, Any] = Field(description="dotted path -> the value this trial tries")
    value: float | None = Field(description="the sweep's metric: a succeeded trial's final (kept epoch's) value, "
                                            "otherwise the latest reported")
    epoch: int | None
    epochs: int | None
    best: bool = Field(description="the sweep's best trial so far")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class SweepPublic(BaseModel):
    id: int
    name: str | None
    state: SweepState
    owner: str | None = Field(None, description="who submitted it (its trials are theirs too); null: from before "
                                                "accounts")
    method: str
    metric: str
    direction: str
    max_trials: int
    max_concurrent: int
    trial_count: int = Field(description="trials made so far")
    counts: dict[str, int] = Field(description="trials by state: queued, running, succeeded, pruned, failed, cancelled")
    best: dict[str, Any] | None = Field(description="the best succeeded trial so far: {trial, job_id, params, value}")
    created_at: datetime
    finished_at: datetime | None
    error: str | None = Field(description="why the sweep failed or ended")
    spec: dict[str, Any] | None = Field(None, description="the sweep as submitted (GET /sweeps/{id}); null in list "
                                                         "items and events")
    trials: list[TrialPublic] | None = Field(None, description="every trial (GET /sweeps/{id}); null in list items")


class SweepsPublic(BaseModel):
    data: list[SweepPublic]
    count: int
    limit: int
    offset: int


def trial_of(job: Job) -> dict[str, Any]:
    """A sweep's trial's {id, trial, params}: every job a sweep lists has one."""
    if job.sweep is None:
        raise ValueError(f"job {job.id} is not a sweep's trial")
    return job.sweep


def trial_fields(job: Job, metric: str, best: Job | None) -> dict[str, Any]:
    return dict(trial=trial_of(job)["trial"], job_id=job.id, state=job.state, failure=failure(job),
                params=trial_of(job)["params"], value=trial_value(job, metric), epoch=job.epoch, epochs=job.epochs,
                best=best is not None and best.id == job.id, created_at=ts(job.created_at),
                started_at=ts(job.started_at), finished_at=ts(job.finished_at))


def sweep_fields(row: dict, found: list[Job], with_trials: bool = True) -> dict[str, Any]:
    """A sweep as SweepPublic's plain values. A row read with its spec (GET /sweeps/{id}) shows it; one read with
    its summary instead (sweeps.page, get_summary: list items, events) shows `spec: null`. The stored spec was
    validated at submit and is not validated again here."""
    plan = row["summary"] if "summary" in row else summary(row["spec"])
    best = best_trial(plan, found)
    return dict(
        id=row["id"], name=row["name"], state=row["state"], owner=row.get("owner"), method=plan["method"],
        metric=plan["metric"], direction=plan["direction"], max_trials=plan["max_trials"],
        max_concurrent=plan["max_concurrent"], trial_count=max(row["trial_count"], len(found)), counts=counts(found),
        best=None if best is None else {"trial": trial_of(best)["trial"], "job_id": best.id,
                                        "params": trial_of(best)["params"], "value": trial_value(best, plan["metric"])},
        created_at=ts(row["created_at"]), finished_at=ts(row["finished_at"]), error=row["error"],
        spec=row.get("spec"), trials=[trial_fields(j, plan["metric"], best) for j in found] if with_trials else None)
