"""Routes for sweeps: submit, list, read, trials, curves, cancel, delete (events: routes/events.py)."""
from typing import Annotated, Literal, cast

from fastapi import APIRouter, Body, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool

from trainyard.app.accounts import Principal, audit
from trainyard.app.api.deps import EngineDep, SettingsDep, WhoDep, client_address
from trainyard.app.api.routes.jobs import as_json
from trainyard.app.api.schemas import responses
from trainyard.app.api.schemas_service import CurvesPublic
from trainyard.app.api.schemas_sweeps import SweepPublic, SweepsPublic, TrialPublic, sweep_fields
from trainyard.app.core.states import SWEEP_STATES, SweepState
from trainyard.app.lifecycle import deletion
from trainyard.app.records import Sweep, sweep_reads
from trainyard.app.spec import MAX_ID, TRAIN_EXAMPLE, SweepSpec
from trainyard.app.sweeps import sweep_store
from trainyard.app.sweeps.sweep_curves import MAX_CURVE_POINTS, curves

router = APIRouter(prefix="/sweeps", tags=["sweeps"])
SweepId = Annotated[int, PathParam(ge=1, le=MAX_ID)]
NOT_FOUND = responses(not_found="no such sweep")
EVENTS_POLL_S = 0.5  # how often the hub reads a watched sweep

EXAMPLE = {
    "name": "iris-lr", "job": {**TRAIN_EXAMPLE, "train": {**cast(dict, TRAIN_EXAMPLE["train"]), "epochs": 30}},
    "parameters": {"train.lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True},
                   "model.hidden": {"type": "choice", "values": [[8], [16, 16], [32]]}},
    "method": "tpe", "metric": "val_loss", "max_trials": 12, "max_concurrent": 2, "startup_trials": 4,
    "pruner": {"type": "median", "startup_trials": 3, "warmup_epochs": 5},
}


def _fields(engine, sweep: Sweep, with_trials: bool = True) -> dict:
    """SweepPublic's values of the sweep, its trials read."""
    return sweep_fields(sweep.as_dict(), sweep_reads.trials(engine, [sweep.id])[sweep.id], with_trials)


def _sweep(engine, sweep_id: int, who: Principal | None = None) -> dict:
    return _fields(engine, sweep_reads.get(engine, sweep_id, who))


def watched(engine, sweep_id: int, who: Principal | None = None) -> dict:
    """What the event stream follows: the sweep without its spec (never read whole for it), with its trials."""
    return _fields(engine, sweep_reads.get_summary(engine, sweep_id, who))


@router.post("", status_code=201, response_model=SweepPublic, operation_id="submit_sweep",
             responses=responses(conflict="its project runs its part of the sweeps, or the server all it may"))
async def submit_sweep(spec: Annotated[SweepSpec, Body(openapi_examples={"tpe": {"summary": "TPE over lr and "
                                                                         "hidden sizes, median pruning",
                                                                         "value": EXAMPLE}})],
                       engine: EngineDep, settings: SettingsDep, request: Request, who: WhoDep) -> Response:
    """Start a sweep: its trials are jobs of the base job with the searched fields set (the first within
    a second). Bad paths, ranges on fields that are not numbers, values the job spec refuses and a grid
    larger than max_trials are refused with 422 naming the field; past the caller's project's part of
    TRAINYARD_MAX_RUNNING_SWEEPS sweeps running, or past the cap itself, 409 (app/sweeps/sweep_admission.py). The sweep
    and its trials are the caller's, in the caller's project."""
    made = await run_in_threadpool(sweep_store.create, engine, settings, spec, who)
    await run_in_threadpool(audit.record, engine, who, "sweep_submit", f"sweep {made.id}", client_address(request),
                            {"name": spec.name, "method": spec.method})
    searcher = getattr(request.app.state, "searcher", None)
    if searcher is not None:
        searcher.poke()  # this process may be the one that drives sweeps: start the trials now
    return as_json(sweep_fields(made.as_dict(), []), 201)


@router.get("", response_model=SweepsPublic, operation_id="list_sweeps")
def list_sweeps(engine: EngineDep, who: WhoDep,
                state: Annotated[str | None, Query(pattern=f"^({'|'.join(SWEEP_STATES)})$")] = None,
                limit: Annotated[int, Query(ge=1, le=500)] = 50,
                offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> Response:
    """Sweeps, newest first (without their trials: GET /sweeps/{id} has them); a user's, their project's."""
    rows, count = sweep_reads.page(engine, SweepState(state) if state else None, limit, offset, who)
    found = sweep_reads.trials(engine, [r.id for r in rows])
    return as_json({"data": [sweep_fields(r.as_dict(), found[r.id], with_trials=False) for r in rows], "count": count,
                    "limit": limit, "offset": offset})


@router.get("/{sweep_id}", response_model=SweepPublic, responses=NOT_FOUND, operation_id="get_sweep")
def get_sweep(sweep_id: SweepId, engine: EngineDep, who: WhoDep) -> Response:
    """State, counts by state, the best trial so far, and every trial's values and metric."""
    return as_json(_sweep(engine, sweep_id, who))


@router.get("/{sweep_id}/trials", response_model=list[TrialPublic], responses=NOT_FOUND,
            operation_id="sweep_trials")
def sweep_trials(sweep_id: SweepId, engine: EngineDep, who: WhoDep) -> Response:
    return as_json(_sweep(engine, sweep_id, who)["trials"])


@router.get("/{sweep_id}/curves", response_model=CurvesPublic, responses=NOT_FOUND, operation_id="sweep_curves")
def sweep_curves(sweep_id: SweepId, engine: EngineDep, who: WhoDep,
                 # A cursor is a metric record's id (an INTEGER column): a larger one is a 422, not a failed query.
                 since: Annotated[int, Query(ge=0, le=MAX_ID, description="the `next` of the page before; 0: from "
                                             "the start")] = 0,
                 limit: Annotated[int, Query(ge=1, le=MAX_CURVE_POINTS, description="points at most")]
                 = MAX_CURVE_POINTS) -> Response:
    """Every trial's metric per epoch ([epoch, value] points), for one chart, a page at a time: the points
    recorded after `since`, in the order they were recorded; `next` is the cursor of the next page (and, once
    `more` is false, of the points that will come), so a client that keeps it reads each point once. An epoch
    recorded again (a resumed run) comes again: its last point holds."""
    sweep_reads.visible(engine, sweep_id, who)
    return as_json(curves(engine, sweep_id, since, limit))


@router.post("/{sweep_id}/cancel", response_model=SweepPublic, operation_id="cancel_sweep",
             responses={**NOT_FOUND, **responses(conflict="the sweep has ended")})
def cancel_sweep(sweep_id: SweepId, engine: EngineDep, who: WhoDep, request: Request) -> Response:
    """End the sweep and cancel its queued and running trials (stopped within 2 s); finished trials stay."""
    sweep_reads.visible(engine, sweep_id, who)
    sweep_store.cancel(engine, sweep_id)
    audit.record(engine, who, "sweep_cancel", f"sweep {sweep_id}", client_address(request))
    return as_json(_sweep(engine, sweep_id))


@router.delete("/{sweep_id}", status_code=204, response_class=Response, operation_id="delete_sweep",
               responses={**NOT_FOUND, **responses(conflict="the sweep is running, a job waits for its best trial, "
                                                             "or one of its trials is kept (pinned, or named by a "
                                                             "job that has not ended)")})
def delete_sweep(sweep_id: SweepId, engine: EngineDep, settings: SettingsDep, who: WhoDep, request: Request,
                 keep: Annotated[Literal["best"] | None, Query(description="best: keep the best trial's job "
                                                                           "(detached from the sweep)")] = None
                 ) -> Response:
    """Delete an ended sweep, its study and its trials' jobs (their rows and stored objects), all or nothing."""
    sweep_reads.visible(engine, sweep_id, who)
    kept = deletion.delete_sweep(engine, settings.store, sweep_id, keep_best=keep == "best")
    audit.record(engine, who, "sweep_delete", f"sweep {sweep_id}", client_address(request),
                 {"kept": kept} if keep else None)
    return Response(status_code=204)
