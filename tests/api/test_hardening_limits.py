"""Limits, shares and priorities past what the database can hold (issue 37, "Unbounded limits"), on both databases:
the API refuses them with a 422 naming the field, and a value stored before the bounds existed stops no claim,
no idle worker's poll and no preemption pass: the project's job and another's run, the worker lives on, and the
server's log names the row once instead of a traceback a second (app/accounts/project_limits.py)."""
import logging
import math

import pytest
from sqlalchemy import update

from tests.helpers.backends import BACKENDS
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import live_service
from tests.helpers.teams import service_engine
from trainyard.app.accounts import project_limits
from trainyard.app.db import projects, write

PAST_THEIR_BOUNDS = [({"limits": {"devices": 99_999_999_999}}, "devices"),
                     ({"limits": {"gpu_memory_gb": 1e308}}, "gpu_memory_gb"),
                     ({"limits": {"queued_jobs": 2**31}}, "queued_jobs"),
                     ({"limits": {"running_sweeps": 2**31}}, "running_sweeps"),
                     ({"limits": {"stored_bytes": 2**63}}, "stored_bytes"),
                     ({"share": 1e308}, "share")]


# The real server (preempting runs of a second or more) and a team, on each database; a test that needs a
# worker starts one.
live = live_service(workers=0, env={"TRAINYARD_PREEMPT_MIN_RUN_S": "1"}, backends=BACKENDS, team=True)


def named(r, field: str) -> bool:
    return r.status_code == 422 and any(field in map(str, e["loc"]) for e in r.json()["detail"])


def test_limits_shares_and_priorities_past_their_bounds_are_refused_naming_them(live):
    svc, team = live
    with team.client("ada") as admin, team.client("ann") as ann:
        for body, field in PAST_THEIR_BOUNDS:
            r = admin.patch("/admin/projects/alpha", json=body)
            assert named(r, field), (body, r.status_code, r.text)
            r = admin.post("/admin/projects", json={"name": "gamma", **body})
            assert named(r, field), (body, r.status_code, r.text)
        at_bounds = {"devices": 1_000_000, "gpu_memory_gb": 1e6, "queued_jobs": 10**9, "running_sweeps": 10**9,
                     "stored_bytes": 2**62}
        r = admin.patch("/admin/projects/alpha", json={"limits": at_bounds, "share": 1e6})
        assert r.status_code == 200 and r.json()["limits"] == at_bounds, r.text
        r = admin.patch("/admin/projects/alpha", json={"limits": dict.fromkeys(at_bounds), "share": 1})
        assert r.status_code == 200 and r.json()["limits"] == {}, r.text
        r = ann.post("/jobs", json={**tiny_job(), "priority": 2**31})
        assert named(r, "priority"), r.text


@pytest.mark.slow
def test_a_stored_limit_past_its_bound_stops_no_claim_and_no_preemption(live):
    svc, team = live
    engine = service_engine(svc)
    try:  # as a row written before the bounds existed: PostgreSQL's claim cast 99999999999 to INTEGER and failed
        with write(engine) as conn:
            conn.execute(update(projects).where(projects.c.name == "beta").values(
                limits={"devices": 99_999_999_999, "gpu_memory_gb": 1e308}))
    finally:
        engine.dispose()
    worker = svc.start_worker("cpu")
    with team.client("ann") as ann, team.client("ben") as ben, team.client("ada") as admin:
        first = ann.post("/jobs", json=tiny_job()).json()["id"]  # alpha's device time: over its share after
        assert svc.wait_state(first, timeout=60)["state"] == "succeeded"
        long = ann.post("/jobs", json=slow_job(epochs=200)).json()["id"]
        svc.wait_state(long, "running", timeout=60)
        # beta is under its share, alpha over: the preemption pass gives beta's job alpha's device.
        theirs = ben.post("/jobs", json=tiny_job()).json()["id"]
        assert svc.wait_state(theirs, timeout=60)["state"] == "succeeded"
        entries = admin.get("/admin/audit", params={"action": "preempt"}).json()
        assert [(e["target"], e["detail"]) for e in entries] == [(f"job {long}", {"for": theirs})]
        assert admin.post(f"/jobs/{long}/cancel").status_code == 200
        after = ann.post("/jobs", json=tiny_job()).json()["id"]
        assert svc.wait_state(after, timeout=60)["state"] == "succeeded"
    assert worker.poll() is None, svc.output()
    server_log = (svc.data_dir / "server.out").read_text()
    for key, value in (("devices", "99999999999"), ("gpu_memory_gb", "1e+308")):
        assert server_log.count(f"project 'beta': its stored {key} {value} is over the most it may be") == 1, \
            server_log[-4000:]
    assert "Traceback" not in server_log, server_log[-4000:]


def test_a_stored_value_is_held_to_its_bound_or_left_out_and_said_once(caplog):
    caplog.set_level(logging.WARNING, "trainyard.limits")
    stored = {"devices": 10**40, "gpu_memory_gb": math.inf, "queued_jobs": "lots", "running_sweeps": -1,
              "stored_bytes": 2.5, "max_priority": 5000}
    for _ in range(3):  # a claim, a poll, a pass: each reads it
        held = project_limits.bounded(9999, "delta", math.nan, stored)
    assert held.limits == {"devices": 1_000_000, "gpu_memory_gb": 1e6, "max_priority": 1000}
    assert held.share == 1.0
    assert project_limits.bounded(9998, "epsilon", 1e308, ["devices"]) == \
        project_limits.ProjectLimits(9998, "epsilon", project_limits.MAX_SHARE, {})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 9, lines  # once each: 7 of delta's values, 2 of epsilon's
    assert "project 'delta': its stored queued_jobs 'lots' is not a whole number >= 0: the project has no such " \
           "limit" in lines[2]
