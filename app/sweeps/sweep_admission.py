"""Whether a sweep can run, checked before it is stored (within the caps on running sweeps, each path a field of
the base job, ranges only on numbers, every value it may try one the job spec and the fleet accept), and the job
each trial runs."""
import json
import math
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from trainyard.app.accounts import Principal, quotas
from trainyard.app.core.errors import Conflict, Invalid
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import SweepState
from trainyard.app.db import read, sweeps
from trainyard.app.jobs import admission
from trainyard.app.spec import (
    INTEGER,
    MAX_CHOICE_BYTES,
    MAX_CHOICE_VALUES,
    MAX_SWEEP_TRIALS,
    OTHER,
    TRAIN_SWEEP_METRICS,
    ChoiceParam,
    FloatParam,
    JobSpec,
    SweepSpec,
    field_kind,
    job_spec_adapter,
    with_params,
)

# Choice values each checked by the job spec at submit; the workers' admission runs on the first few of
# each parameter, and on at most ADMIT_CALLS in all (each looks the installed plugins up: tens of ms).
ADMIT_VALUES = 8
ADMIT_CALLS = 32


def admit(engine: Engine, settings: Settings, spec: SweepSpec, who: Principal | None = None) -> None:
    """Refuse a sweep that cannot run (Invalid), naming the field: each path must be a field of the base job,
    ranges only on numbers, and every value checked, and the base job itself, must make a job the spec and
    the fleet accept, as `who` submits it (a model job or an upload of another project does not exist); and within
    who's project's running_sweeps and stored_bytes limits (Conflict: app/accounts/quotas.py) and the server's caps on
    running sweeps (Conflict: check_running), and the highest priority its trials may run at within its
    max_priority (Invalid)."""
    quotas.check_sweep(engine, who, highest_priority(spec))
    check_running(engine, settings, who)
    _admit_choices(spec)
    kind, base = spec.job.kind, spec.job.model_dump(mode="json")
    admitted = min(ADMIT_VALUES, max(1, ADMIT_CALLS // len(spec.parameters)))  # values per parameter
    for path, p in spec.parameters.items():
        at = ("parameters", path)
        try:
            holds = field_kind(path, kind)
        except ValueError as e:
            raise Invalid(str(e), loc=at) from None
        if isinstance(p, FloatParam) and holds == INTEGER:
            raise Invalid(f"{path} is an integer field: search it with type int or choice", loc=(*at, "type"))
        if not isinstance(p, ChoiceParam) and holds == OTHER:
            raise Invalid(f"{path} is not a number: a range (type {p.type}) needs a numeric field; "
                          "give its values with type choice", loc=(*at, "type"))
        values = p.values if isinstance(p, ChoiceParam) else [p.low, p.high]
        _admit_values(engine, settings, base, path, values, admitted, who)
    if kind == "train" and spec.metric not in TRAIN_SWEEP_METRICS:
        raise Invalid(f"a train job reports {', '.join(TRAIN_SWEEP_METRICS)}; not {spec.metric!r}", loc=("metric",))
    if spec.method == "grid":
        _admit_grid(spec)
    try:
        admission.admit(engine, settings, spec.job, who=who)
    except Invalid as e:
        raise Invalid(str(e), loc=("job", *(e.loc or ()))) from None


def check_running(engine: Engine, settings: Settings, who: Principal | None) -> None:
    """Refuse a sweep (Conflict) while who's project runs its part of TRAINYARD_MAX_RUNNING_SWEEPS (a member's;
    Settings.per_project), then while the server runs the whole cap. A member is told their project's count
    only; admins and requests in no project meet the cap itself and are told the server's."""
    project = who.project_id if who is not None and not who.admin else None
    running = sweeps.c.state == SweepState.RUNNING.value
    with read(engine) as conn:
        total = conn.execute(select(func.count()).select_from(sweeps).where(running)).scalar_one()
        own = 0 if project is None else conn.execute(
            select(func.count()).select_from(sweeps).where(running, sweeps.c.project_id == project)).scalar_one()
    if project is None:
        if total >= settings.max_running_sweeps:
            raise Conflict(f"{total} sweeps are running, the limit (TRAINYARD_MAX_RUNNING_SWEEPS); wait for one to "
                           "end, or cancel one")
        return
    assert who is not None
    share = settings.per_project("max_running_sweeps")
    if own >= share:
        raise Conflict(f"project {who.project} has {own} running sweep{'s' if own != 1 else ''}, its part of the "
                       f"server's cap of running sweeps: {share} (TRAINYARD_MAX_RUNNING_SWEEPS_PER_PROJECT); wait "
                       "for one to end, or cancel one")
    if total >= settings.max_running_sweeps:
        # Said without the count: how much other projects run is theirs.
        raise Conflict("the server runs as many sweeps as it allows (TRAINYARD_MAX_RUNNING_SWEEPS); try again "
                       "when one has ended")


def highest_priority(spec: SweepSpec) -> tuple[float, tuple[str, ...]]:
    """The highest priority a trial may run at, and the field that sets it: the job's, or its `priority`
    parameter's highest value (values that are no priority at all are refused later, by the job spec)."""
    p = spec.parameters.get("priority")
    if p is None:
        return spec.job.priority, ("job", "priority")
    values = p.values if isinstance(p, ChoiceParam) else [p.high]
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    return max(numbers, default=spec.job.priority), ("parameters", "priority")


def _admit_choices(spec: SweepSpec) -> None:
    choices = [p.values for p in spec.parameters.values() if isinstance(p, ChoiceParam)]
    if sum(map(len, choices)) > MAX_CHOICE_VALUES:
        raise Invalid(f"the choices hold {sum(map(len, choices)):,} values in all; a sweep takes at most "
                      f"{MAX_CHOICE_VALUES:,}", loc=("parameters",))
    if sum(len(json.dumps(v)) for v in choices) > MAX_CHOICE_BYTES:
        raise Invalid(f"the choices' values are over {MAX_CHOICE_BYTES >> 10} KiB of JSON in all",
                      loc=("parameters",))


def _admit_values(engine: Engine, settings: Settings, base: dict, path: str, values: list, admitted: int,
                  who: Principal | None) -> None:
    """Each value makes a job the spec accepts; the first `admitted`, one the fleet accepts (as `who`)."""
    at = ("parameters", path)
    for i, value in enumerate(values):
        job = _trial_job(base, {path: value}, at)
        if i < admitted:
            try:
                admission.admit(engine, settings, job, who=who)
            except Invalid as e:
                raise Invalid(str(e), loc=at) from None


def _admit_grid(spec: SweepSpec) -> None:
    try:
        size = spec.grid_size()
    except (ValueError, ArithmeticError) as e:
        raise Invalid(str(e), loc=("method",)) from None
    if spec.max_trials is not None and spec.max_trials < size:
        raise Invalid(f"the grid has {size:,} combinations; max_trials {spec.max_trials} would leave some out "
                      "(raise it, or use method random or tpe)", loc=("max_trials",))
    if size > MAX_SWEEP_TRIALS:
        raise Invalid(f"the grid has {size:,} combinations, over the limit of {MAX_SWEEP_TRIALS}",
                      loc=("parameters",))


def _trial_job(base: dict, params: dict, at: tuple) -> JobSpec:
    try:
        return job_spec_adapter.validate_python(with_params(base, params))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"][1:])  # the first is the job's kind (the union's tag)
        shown = json.dumps(next(iter(params.values())))[:100]
        raise Invalid(f"{at[-1]} = {shown} makes a job the spec refuses: {where}: {first['msg']}", loc=at) from None


def trial_spec(spec: SweepSpec, trial: int, params: dict[str, Any]) -> JobSpec:
    """The job a trial runs (Invalid: the job spec refuses this combination of values)."""
    job = _trial_job(spec.job.model_dump(mode="json"), params, ("parameters",))
    return job.model_copy(update={"name": f"{spec.name or spec.job.name or 'sweep'}/trial-{trial}"[-200:]})
