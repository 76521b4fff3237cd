"""The caps that guard the server, shared between projects (issue 37): one project's running sweeps, uploads and
open event streams take at most its part of each service-wide cap, so another project's next request still
succeeds; a refusal counts only the caller's own project; GET /storage shows a member their own project only.
A real server with small caps and a team (ann in alpha, ben in beta, ada an admin); no worker: sweeps stay
running and jobs queued, which is all the caps count."""
from contextlib import ExitStack

import httpx

from tests.helpers.jobs import tiny_job
from tests.helpers.service import live_service

ROOT = "root-token-caps"
# Parts: sweeps 1 and uploads 1 (half the cap, the default), streams 3 (set).
CAPS = {"TRAINYARD_API_TOKEN": ROOT, "TRAINYARD_MAX_RUNNING_SWEEPS": "2", "TRAINYARD_MAX_UPLOADS": "3",
        "TRAINYARD_MAX_EVENT_STREAMS": "6", "TRAINYARD_MAX_EVENT_STREAMS_PER_PROJECT": "3"}
CSV = ("a,b,label\n" + "".join(f"{i},{i % 3},{'x' if i % 2 else 'y'}\n" for i in range(12))).encode()
SWEEP = {"job": tiny_job(), "method": "grid", "parameters": {"train.lr": {"type": "choice", "values": [0.01, 0.05]}}}


live = live_service(workers=0, env=CAPS, team=True)


def upload(c: httpx.Client) -> httpx.Response:
    return c.post("/datasets", files={"file": ("tiny.csv", CSV)}, data={"label_column": "label"})


def others_unnamed(detail: str) -> None:
    """A refusal to ann names her project and nothing of beta's."""
    assert "alpha" in detail and "beta" not in detail and "ben" not in detail, detail


def test_one_projects_sweeps_leave_the_others_room(live):
    svc, team = live
    with team.client("ann") as ann, team.client("ben") as ben, team.client("ada") as ada:
        # ann submits as many as the server would take: her project's part is all she gets.
        answers = [ann.post("/sweeps", json=SWEEP) for _ in range(2)]
        assert [r.status_code for r in answers] == [201, 409], [r.text for r in answers]
        detail = answers[1].json()["detail"]
        others_unnamed(detail)
        assert "project alpha has 1 running sweep" in detail and "TRAINYARD_MAX_RUNNING_SWEEPS_PER_PROJECT" in detail
        r = ben.post("/sweeps", json=SWEEP)
        assert r.status_code == 201, r.text
        # The cap itself still holds: two are running, so the admin's is refused (an admin is told the count).
        r = ada.post("/sweeps", json=SWEEP)
        assert r.status_code == 409 and "2 sweeps are running" in r.json()["detail"], r.text


def test_one_projects_uploads_leave_the_others_room(live):
    svc, team = live
    with team.client("ann") as ann, team.client("ben") as ben:
        answers = []
        for _ in range(3):  # the server's whole cap, if she could
            answers.append(upload(ann))
            if answers[-1].status_code != 201:
                break
        assert [r.status_code for r in answers] == [201, 413], [r.text for r in answers]
        detail = answers[-1].text  # a 413 of the form's file field: [{"loc": ["body", "file"], "msg": ...}]
        others_unnamed(detail)
        assert "project alpha's upload number 2" in detail and "TRAINYARD_MAX_UPLOADS_PER_PROJECT" in detail
        r = upload(ben)
        assert r.status_code == 201, r.text
    with team.client("ada") as ada:
        # ada acts in no project: no part applies, the cap itself does (3 uploads), told with its count.
        answers = [upload(ada) for _ in range(2)]
        assert [r.status_code for r in answers] == [201, 413] and "at most 3" in answers[1].text, answers[1].text


def test_one_projects_streams_leave_the_others_room(live):
    svc, team = live
    with team.client("ann") as ann, team.client("ben") as ben, ExitStack() as held:
        mine = ann.post("/jobs", json=tiny_job()).json()["id"]
        theirs = ben.post("/jobs", json=tiny_job()).json()["id"]
        codes = []
        for _ in range(6):  # the server process's whole cap, if she could
            r = held.enter_context(ann.stream("GET", f"/jobs/{mine}/events"))
            codes.append(r.status_code)
            if r.status_code != 200:
                r.read()
                refused = r.json()["detail"]
                break
        assert codes == [200, 200, 200, 503], codes
        others_unnamed(refused)
        assert "3 event streams" in refused and "TRAINYARD_MAX_EVENT_STREAMS_PER_PROJECT" in refused
        with ben.stream("GET", f"/jobs/{theirs}/events") as r:
            assert r.status_code == 200


def test_a_member_sees_only_their_projects_storage(live):
    svc, team = live
    data_dir = svc.env["TRAINYARD_DATA_DIR"]
    for user in ("ann", "ben"):
        with team.client(user) as c:
            if not c.get("/datasets").json()["count"]:
                assert upload(c).status_code == 201
    with team.client("ada") as ada:
        assert ada.post("/storage/collect").status_code == 200
        everything = ada.get("/storage").json()
    assert data_dir in everything["store"] and everything["kinds"]["uploads"]["objects"] >= 4  # both projects'
    seen = {}
    for user in ("ann", "ben"):
        with team.client(user) as c:
            r = c.get("/storage")
        assert r.status_code == 200
        got = r.json()
        assert data_dir not in r.text and got["store"] is None and got["kinds"] == {}, r.text
        seen[user] = got["project"]
    assert seen["ann"]["name"] == "alpha" and seen["ben"]["name"] == "beta"
    assert "beta" not in str(seen["ann"]) and seen["ann"]["bytes"] > 0 and seen["ann"]["objects"] >= 2
    # Neither project has a job's files yet (no worker): their bytes are their uploads, among all the admin sees.
    assert 0 < seen["ann"]["bytes"] + seen["ben"]["bytes"] <= everything["kinds"]["uploads"]["bytes"]
