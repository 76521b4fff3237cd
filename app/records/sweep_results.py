"""What a sweep and its trials say, worked out from records without the database: its plan (from the stored
spec, validated when it was submitted and not again), each trial's metric and failure, the counts by state,
the best trial, and the latest failure."""
from collections.abc import Callable, Iterable
from typing import Any

from trainyard.app.core.states import JobState
from trainyard.app.records import Job, SweepPlan
from trainyard.app.spec import DEFAULT_TRIALS, HIGHER_IS_BETTER, MAX_SWEEP_TRIALS, range_count

# Counts by trial: the job states (a pruned trial's job ends `pruned`), in the order they are shown.
COUNT_KEYS = ("queued", "running", "succeeded", "pruned", "failed", "cancelled")


def summary(spec: dict[str, Any]) -> SweepPlan:
    """What a stored spec says of the sweep's plan: method, metric, direction, max_trials (SweepSpec.trials),
    max_concurrent."""
    return {"method": spec["method"], "metric": spec["metric"], "direction": goal(spec),
            "max_trials": planned(spec["method"], spec.get("max_trials"), lambda: spec["parameters"]),
            "max_concurrent": spec["max_concurrent"]}


def planned(method: str, max_trials: int | None, parameters: Callable[[], dict]) -> int:
    """SweepSpec.trials of a stored spec; parameters() gives its parameters, called only for a grid."""
    if method != "grid":
        return max_trials or DEFAULT_TRIALS
    size = 1
    for p in parameters().values():
        if p["type"] == "choice":
            size *= len(p["values"])
        else:  # an int range, or a float range with a step (a grid has no other)
            size *= range_count(p["low"], p["high"], p.get("step") or 1)
    return min(size, max_trials or MAX_SWEEP_TRIALS)


def goal(spec: dict[str, Any] | SweepPlan) -> str:
    """SweepSpec.goal of a stored spec (or a plan), without validating it again."""
    return spec.get("direction") or ("maximize" if HIGHER_IS_BETTER.get(spec["metric"]) else "minimize")


def failure(job: Job) -> str | None:
    """Why the trial's job did not finish: its error's class ("pruned" for a pruned one)."""
    return job.error.get("class") if job.error and job.state in (JobState.FAILED, JobState.PRUNED) else None


def trial_value(job: Job, metric: str) -> float | None:
    """The trial's metric: a finished train job's result holds its kept epoch's; otherwise the latest reported."""
    for source in ((job.result or {}) if job.state == JobState.SUCCEEDED else {}, job.latest_metrics or {}):
        value = source.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def best_trial(plan: dict[str, Any] | SweepPlan, found: list[Job]) -> Job | None:
    """The succeeded trial with the best metric (the lowest trial number among equals)."""
    best = best_trials(plan, found, 1)
    return best[0] if best else None


def best_trials(plan: dict[str, Any] | SweepPlan, found: list[Job], k: int) -> list[Job]:
    """The k succeeded trials with the best metric, best first (the lowest trial number among equals)."""
    sign = -1.0 if goal(plan) == "maximize" else 1.0
    done = sorted((sign * v, trial_number(j), j.id) for j in found if j.state == JobState.SUCCEEDED
                  and (v := trial_value(j, plan["metric"])) is not None)
    by_id = {j.id: j for j in found}
    return [by_id[t[2]] for t in done[:k]]


def trial_number(job: Job) -> int:
    assert job.sweep is not None, f"job {job.id} is no sweep's trial"
    return job.sweep["trial"]


def counts(found: list[Job]) -> dict[str, int]:
    out = dict.fromkeys(COUNT_KEYS, 0)
    for j in found:
        out[j.state.value] += 1
    return out


def latest_error(found: Iterable[Job]) -> str:
    """The latest trial failure that was no pruning, as a sweep that fails for its trials says it."""
    failed = [j for j in found if j.state == JobState.FAILED]
    if not failed:
        return "none of its trials reported it"
    last = max(failed, key=lambda j: j.finished_at or 0)
    return f"job {last.id}: {last.error.get('message', 'failed') if last.error else 'failed'}"
