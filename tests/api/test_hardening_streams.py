"""An open event stream serves only whom it was opened for (issue 37): a stream opened with a user's token ends,
with `end` naming why, within a few seconds of the token's revocation or of its user's removal from the project,
whether its job is running, queued or a sweep's; it does not run on to the job's end. Before, such streams went
on sending every epoch, the terminal state and `end` (or sat open on a queued job) after the token was refused
everywhere else. The real server and a CPU worker, on SQLite and on PostgreSQL, read with httpx-sse."""
import time
from collections.abc import Callable
from contextlib import suppress

import httpx
import pytest
from httpx_sse import connect_sse

from tests.helpers.backends import BACKENDS
from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import live_service
from tests.helpers.teams import Team
from trainyard.app.api.deps import COOKIE
from trainyard.app.api.streams import RECHECK_S, TOKEN_GONE

pytestmark = pytest.mark.slow  # starts the real server and a worker

WAITING = {**tiny_job(), "device": "cuda"}  # no worker serves CUDA here: it stays queued
# The stream must end within this long of the revocation: one re-check interval, a poll, and the test's slack.
PATIENCE_S = RECHECK_S + 3.0


live = live_service(backends=BACKENDS, team=True)  # the team: ann in alpha, ada an admin


def fresh_token(team: Team, user: str = "ann", project: str = "alpha") -> tuple[int, str]:
    """A token of the user's own for one test, issued by the admin ada: (its id, the token)."""
    with team.client("ada") as ada:
        made = ada.post(f"/admin/users/{user}/tokens", json={"project": project})
    assert made.status_code == 201, made.text
    return made.json()["id"], made.json()["token"]


def read_until_gone(team: Team, token: str, path: str, ready: Callable[[str, dict], bool],
                    take_away: Callable[[], None], cookie: str | None = None) -> tuple[list[tuple[str, dict]], float]:
    """Follow the stream at path with token (or with the dashboard's session cookie); once ready(event, data),
    take_away() the caller's right and read on until the stream closes, or for PATIENCE_S at most (a stream still
    open with nothing to send ends the read on its timeout). The events read after that, and how long it took."""
    after: list[tuple[str, dict]] = []
    taken_at = None
    timeout = httpx.Timeout(10, read=PATIENCE_S + 2)
    headers = {"Cookie": f"{COOKIE}={cookie}"} if cookie else {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=team.url, headers=headers, timeout=timeout) as c, \
            connect_sse(c, "GET", path) as source:
        assert source.response.status_code == 200
        with suppress(httpx.ReadTimeout):  # open, sending nothing: the assertions below say so
            for sse in source.iter_sse():
                if taken_at is not None:
                    after.append((sse.event, sse.json()))
                elif ready(sse.event, sse.json()):
                    take_away()
                    taken_at = time.monotonic()
                if taken_at is not None and time.monotonic() - taken_at > PATIENCE_S:
                    break  # still streaming: the assertions below say so
    assert taken_at is not None, "the stream closed before it was ready"
    return after, time.monotonic() - taken_at


def revoke(team: Team, token_id: int) -> Callable[[], None]:
    def take_away() -> None:
        with team.client("ada") as ada:
            assert ada.delete(f"/admin/tokens/{token_id}").status_code == 204
    return take_away


def assert_ended_for_the_token(after: list[tuple[str, dict]], took: float, target: int, token: str, path: str,
                               url: str) -> None:
    assert took < PATIENCE_S, f"the stream went on {took:.1f}s after the token was taken away: {after[-3:]}"
    assert after and after[-1] == ("end", {"id": target, "reason": TOKEN_GONE}), after[-3:]
    assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {token}"}).status_code == 401


def test_a_running_jobs_stream_ends_when_its_token_is_revoked(live):
    svc, team = live
    token_id, token = fresh_token(team)
    with team.client("ann") as ann:
        job = ann.post("/jobs", json=slow_job(epochs=500)).json()["id"]
    try:
        path = f"/jobs/{job}/events"
        after, took = read_until_gone(team, token, path, lambda name, data: name == "epoch", revoke(team, token_id))
        assert_ended_for_the_token(after, took, job, token, path, svc.url)
        assert {name for name, _ in after} <= {"epoch", "state", "end"}
        with team.client("ann") as ann:  # the stream ended for the token, not because the job did
            assert ann.get(f"/jobs/{job}").json()["state"] == "running"
    finally:
        with team.client("ann") as ann, suppress(httpx.HTTPError):
            ann.post(f"/jobs/{job}/cancel")
        svc.wait_state(job)


def test_a_queued_jobs_stream_ends_when_its_token_is_revoked(live):
    svc, team = live
    token_id, token = fresh_token(team)
    with team.client("ann") as ann:
        job = ann.post("/jobs", json=WAITING).json()["id"]
    try:
        path = f"/jobs/{job}/events"
        after, took = read_until_gone(team, token, path, lambda name, data: name == "state", revoke(team, token_id))
        assert_ended_for_the_token(after, took, job, token, path, svc.url)
        assert after == [("end", {"id": job, "reason": TOKEN_GONE})]  # the spec is not sent again
    finally:
        with team.client("ann") as ann:
            ann.post(f"/jobs/{job}/cancel")


def test_a_jobs_stream_ends_when_its_user_leaves_the_project(live):
    svc, team = live
    with team.client("ada") as ada:
        assert ada.post("/admin/users", json={"name": "cal"}).status_code == 201
        assert ada.put("/admin/projects/alpha/members/cal").status_code == 200
    _, token = fresh_token(team, "cal")
    with team.client("ann") as ann:
        job = ann.post("/jobs", json=WAITING).json()["id"]

    def remove() -> None:
        with team.client("ada") as ada:
            assert ada.delete("/admin/projects/alpha/members/cal").status_code == 200
    try:
        path = f"/jobs/{job}/events"
        after, took = read_until_gone(team, token, path, lambda name, data: name == "state", remove)
        assert_ended_for_the_token(after, took, job, token, path, svc.url)
    finally:
        with team.client("ann") as ann:
            ann.post(f"/jobs/{job}/cancel")


def test_a_sweeps_stream_ends_when_its_token_is_revoked(live):
    svc, team = live
    token_id, token = fresh_token(team)
    with team.client("ann") as ann:
        made = ann.post("/sweeps", json={"job": WAITING, "method": "grid", "max_concurrent": 1,
                                         "parameters": {"train.lr": {"type": "choice", "values": [0.01, 0.1]}}})
        assert made.status_code == 201, made.text
        sweep = made.json()["id"]
    try:
        path = f"/sweeps/{sweep}/events"
        after, took = read_until_gone(team, token, path, lambda name, data: name == "sweep", revoke(team, token_id))
        assert_ended_for_the_token(after, took, sweep, token, path, svc.url)
    finally:
        with team.client("ann") as ann:
            ann.post(f"/sweeps/{sweep}/cancel")


def test_a_dashboard_sessions_stream_ends_when_it_signs_out(live):
    svc, team = live
    _, token = fresh_token(team)
    signed_in = httpx.post(f"{svc.url}/session", json={"token": token})
    assert signed_in.status_code == 204
    session = signed_in.cookies[COOKIE]
    with team.client("ann") as ann:
        job = ann.post("/jobs", json=WAITING).json()["id"]

    def sign_out() -> None:
        assert httpx.delete(f"{svc.url}/session", cookies={COOKIE: session}).status_code == 204
    try:
        path = f"/jobs/{job}/events"
        after, took = read_until_gone(team, token, path, lambda name, data: name == "state", sign_out, session)
        assert took < PATIENCE_S, f"the stream went on {took:.1f}s after its session ended: {after[-3:]}"
        assert after == [("end", {"id": job, "reason": TOKEN_GONE})]
    finally:
        with team.client("ann") as ann:
            ann.post(f"/jobs/{job}/cancel")
