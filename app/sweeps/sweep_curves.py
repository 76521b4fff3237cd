"""A sweep's learning curves: every trial's metric per epoch, for one chart, a page at a time."""
import math

from sqlalchemy import select
from sqlalchemy.engine import Engine

from trainyard.app.db import metrics, read
from trainyard.app.records.sweep_reads import get_summary, trials
from trainyard.app.records.sweep_results import best_trial, failure, trial_number

# Points of GET /sweeps/{id}/curves per response, at most (a limit of the request's own may be lower).
MAX_CURVE_POINTS = 10_000


def curves(engine: Engine, sweep_id: int, since: int = 0, limit: int = MAX_CURVE_POINTS) -> dict:
    """Every trial's metric per epoch, for one chart, a page at a time: the points recorded after the cursor
    `since` (0: from the start), at most `limit` of them, in the order they were recorded; `next` is the cursor
    of the next page (and of the points recorded later), `more` whether points were left for it. An epoch
    recorded again (a resumed run) comes again, later: the last point of an epoch is the one that holds."""
    plan = get_summary(engine, sweep_id).summary
    found = trials(engine, [sweep_id])[sweep_id]
    best = best_trial(plan, found)
    points: dict[int, list] = {j.id: [] for j in found}
    last, more = since, False
    if found:
        # "+ 0": walk the metrics in the order they were recorded (their primary key) from the cursor and stop at
        # the limit, rather than gather all of the trials' points through the (job, epoch) index to sort them.
        # The metric alone is taken out of each record's JSON, by the database (a number on SQLite, text on
        # PostgreSQL): no record is decoded whole.
        query = (select(metrics.c.id, metrics.c.job_id, metrics.c.epoch,
                        metrics.c.data[plan["metric"]].as_string().label("value"))
                 .where((metrics.c.job_id + 0).in_(list(points)), metrics.c.id > since)
                 .order_by(metrics.c.id).limit(limit + 1))
        with read(engine) as conn:
            rows = conn.execute(query).all()
        more = len(rows) > limit
        for r in rows[:limit]:
            last = r.id
            value = _number(r.value)
            if value is not None:
                points[r.job_id].append([r.epoch, value])
    return {"metric": plan["metric"], "direction": plan["direction"], "next": last, "more": more,
            "trials": [{"trial": trial_number(j), "job_id": j.id, "state": j.state, "failure": failure(j),
                        "best": best is not None and j.id == best.id, "points": points[j.id]} for j in found]}


def _number(value) -> float | int | None:
    if isinstance(value, str):  # the metric's JSON text
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None
