"""Fair share and device limits as users meet them: a real server and CPU workers, two projects' users
submitting over HTTP with their own tokens, on each database. A project that queued 10 jobs behind another's 30
starts its first within one job's length and as much device time as the other by its last; a project limited to one
device (12 jobs queued beside another's 6, two workers) never holds two workers, sampled every 100 ms, and its
waiting job says why."""
import threading
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from tests.helpers.backends import BACKENDS, fresh_database
from tests.helpers.service import Service, probe_plugin, run_job
from tests.helpers.teams import make_team, service_engine
from trainyard.app import accounts

pytestmark = pytest.mark.slow
NAP = '''
import time


def nap(ctx, config):
    time.sleep(config["s"])
    return {}
'''
JOB_S = 0.5


@pytest.fixture(scope="module")
def naps(tmp_path_factory):
    return probe_plugin(tmp_path_factory.mktemp("naps"), "trainyard_fair_naps", NAP, ("nap",))


@pytest.fixture(params=BACKENDS)
def database(request) -> Iterator[str]:
    """Each database's URL ("": SQLite in the data directory)."""
    with fresh_database(request.param, "fair") as url:
        yield url


def service(tmp_path, naps, workers: int, database_url: str) -> Service:
    svc = Service(tmp_path / "data", database_url)
    svc.start_server()
    for _ in range(workers):
        svc.start_worker("cpu", env={"PYTHONPATH": str(naps)})
    return svc


def submit_all(client, n: int) -> list[int]:
    ids = []
    for _ in range(n):
        r = client.post("/jobs", json=run_job("nap", s=JOB_S))
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def finished(svc, client, ids: list[int]) -> list[dict]:
    svc.wait_until(lambda: all(client.get(f"/jobs/{i}").json()["state"] == "succeeded" for i in ids), 300,
                   "the jobs to succeed")
    return [client.get(f"/jobs/{i}").json() for i in ids]


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_a_project_behind_another_gets_its_turn_and_half_the_device(tmp_path, naps, database):
    svc = service(tmp_path, naps, 1, database)
    try:
        team = make_team(svc)
        with team.client("ann") as ann, team.client("ben") as ben:
            a = submit_all(ann, 30)
            svc.wait_until(lambda: ann.get(f"/jobs/{a[0]}").json()["state"] != "queued", 60, "ann's first job")
            b_at = time.time()
            b = submit_all(ben, 10)
            done_b = finished(svc, ben, b)
            done_a = finished(svc, ann, a)
    finally:
        svc.stop()
    runs = sorted((ts(j["started_at"]), ts(j["finished_at"]), "ben" if j["id"] in b else "ann")
                   for j in done_a + done_b)
    one_job = max(end - start for start, end, _ in runs)
    first_b = min(start for start, _, who in runs if who == "ben")
    print(f"ben's first job started {first_b - b_at:.2f} s after ben submitted; a job takes up to {one_job:.2f} s")
    assert first_b - b_at <= one_job + 1.0
    # Fair share equalises device time (the half-life, 4 h, decays nothing here): each claim while both have work
    # queued goes to the project that has used less. So when ben's last job ends, ann's device time (her runs before
    # ben came included) and ben's differ by at most one job. (Ben's share of the time since his submit was not a
    # steady half under load: the runs ann made while his submits were still arriving are his to make up.)
    until = max(end for _, end, who in runs if who == "ben")
    used = {"ann": 0.0, "ben": 0.0}
    for start, end, who in runs:
        used[who] += max(0.0, min(end, until) - start)
    print(f"device time until ben's last job ended: ann {used['ann']:.1f} s, ben {used['ben']:.1f} s")
    assert abs(used["ann"] - used["ben"]) <= one_job + 0.25
    assert used["ann"] < 0.5 * JOB_S * 30  # she did not run her whole queue first


def test_a_project_at_its_device_limit_never_holds_two_workers_and_says_why(tmp_path, naps, database):
    svc = service(tmp_path, naps, 2, database)
    try:
        team = make_team(svc)
        engine = service_engine(svc)
        accounts.set_project(engine, "alpha", limits={"devices": 1})
        engine.dispose()
        most, seen_why, stop = [0], [""], threading.Event()
        with team.client("ann") as ann, team.client("ben") as ben:
            def sample() -> None:
                while not stop.is_set():
                    page = ann.get("/jobs", params={"limit": 100}).json()["data"]
                    most[0] = max(most[0], sum(j["state"] == "running" for j in page))
                    seen_why[0] = next((j["waiting_for"] for j in page if j.get("waiting_for")), seen_why[0])
                    time.sleep(0.1)
            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                a = submit_all(ann, 12)
                b = submit_all(ben, 6)
                finished(svc, ben, b)
                finished(svc, ann, a)
            finally:
                stop.set()
                sampler.join()
    finally:
        svc.stop()
    print(f"the most ann's project ran at once: {most[0]}; waiting_for: {seen_why[0]!r}")
    assert most[0] == 1
    assert "project alpha is at its limit of 1 device" in seen_why[0]
