"""What one sweep may cost the service, and what it may not do to the others: a sweep of many large choices
(the server's memory from /proc, the journal's bytes in its database), ranges no float holds, JSON nested
deep, a client's Idempotency-Key in a trial's place, and a sweep whose search fails beside one that goes
on. A real server on a real SQLite database, without workers: trials stay queued, which is all a sweep's
driver needs to be measured."""
import json
import random
import sqlite3
import time

import pytest

from tests.helpers.jobs import tiny_job
from tests.helpers.processes import rss
from tests.helpers.service import Service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("sweep-limits") / "data")
    svc.start_server()
    svc.db = sqlite3.connect(f"{svc.env['TRAINYARD_DATA_DIR']}/trainyard.db", isolation_level=None)
    yield svc
    svc.db.close()
    svc.stop()


def post(svc, path: str, body) -> tuple[int, dict]:
    with svc.client(timeout=60) as c:  # a fresh connection each: a refused request may close its own
        r = c.post(path, content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"})
    return r.status_code, r.json()


def sweep(svc, sweep_id: int) -> dict:
    with svc.client() as c:
        return c.get(f"/sweeps/{sweep_id}").json()


def cancel_all(svc, *ids) -> None:
    with svc.client() as c:
        for i in ids:
            c.post(f"/sweeps/{i}/cancel")


def test_a_sweep_of_many_large_choices_keeps_the_servers_memory_and_its_journal_small(live):
    random.seed(0)
    # The probe that took the server to 3 GB: 16 choices of 10,000 values, 256 trials at once.
    probe = {"job": tiny_job(), "method": "random", "max_trials": 1000, "max_concurrent": 256,
             "parameters": {"model.hidden": {"type": "choice", "values": [[v] for v in random.sample(range(1, 60000),
                                                                                                    10000)]}}}
    status, body = post(live, "/sweeps", probe)
    assert status == 422 and body["detail"][0]["loc"][:3] == ["body", "parameters", "model.hidden"], body
    # The most the bounds let through: 1,000 values (16 ints each) over three fields.
    hidden = [[i + 1, *random.sample(range(100, 1000), 15)] for i in range(600)]
    spec = {**probe, "parameters": {"model.hidden": {"type": "choice", "values": hidden},
                                    "train.lr": {"type": "choice", "values": [round(0.0001 * (i + 1), 6)
                                                                              for i in range(300)]},
                                    "train.batch_size": {"type": "choice", "values": list(range(1, 101))}}}
    status, body = post(live, "/sweeps", {**spec, "parameters": {**spec["parameters"], "train.epochs": {
        "type": "choice", "values": [1]}}})
    assert status == 422 and "1,001 values" in body["detail"][0]["msg"], body
    before = rss(live.server.pid)
    status, made = post(live, "/sweeps", {**spec, "max_concurrent": 128})
    assert status == 201, made
    deadline = time.monotonic() + 60
    while sweep(live, made["id"])["trial_count"] < 128 and time.monotonic() < deadline:
        time.sleep(0.5)
    trials = sweep(live, made["id"])["trial_count"]
    grown = rss(live.server.pid) - before
    journal = live.db.execute("SELECT sum(length(entry)) FROM sweep_log WHERE sweep_id = ?",
                              (made["id"],)).fetchone()[0]
    cancel_all(live, made["id"])
    print(f"{trials} trials of a sweep of 1,000 choice values: journal {journal / trials:,.0f} bytes a trial, "
          f"server RSS +{grown / (1 << 20):.0f} MiB")
    assert trials == 128
    # Each trial's journal entries held every value before (~60 KB a trial here; 1.6 MB in the probe).
    assert journal / trials < 12_000, journal / trials
    assert grown < 150 << 20, grown


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("path, body, loc", [
    ("/sweeps", {"job": tiny_job(), "parameters": {"train.lr": {"type": "float", "low": 0.001, "high": 0.1,
                                                                "step": 1e-320}}, "method": "grid"},
     ["body", "parameters", "train.lr"]),
    ("/sweeps", {"job": {"kind": "run", "entrypoint": "cifar_loop", "device": "cpu"}, "metric": "score",
                 "method": "grid",
                 "parameters": {"config.x": {"type": "float", "low": -1.7e308, "high": 1.7e308, "step": 1e300}}},
     ["body", "parameters", "config.x"]),
    ("/sweeps", {"job": {"kind": "run", "entrypoint": "cifar_loop", "device": "cpu"}, "metric": "score",
                 "parameters": {"config.x": {"type": "float", "low": -1.7e308, "high": 1.7e308}}},
     ["body", "parameters", "config.x"]),
    ("/sweeps", json.dumps({"job": {"kind": "run", "entrypoint": "cifar_loop", "device": "cpu"}, "metric": "score",
                            "parameters": {"config.x": {"type": "choice", "values": ["X"]}}})
     .replace('"X"', nested(900)),
     ["body", "parameters", "config.x", "values"]),
    ("/jobs", json.dumps({"kind": "run", "entrypoint": "cifar_loop", "device": "cpu", "config": {"a": "X"}})
     .replace('"X"', nested(300)), ["body", "config"]),
    ("/jobs", json.dumps({**tiny_job(), "model": {"arch": "tinynet", "params": {"a": "X"}}}).replace('"X"', nested(33)),
     ["body", "model", "params"]),
    ("/jobs", json.dumps({"kind": "run", "entrypoint": "cifar_loop", "device": "cpu", "config": {"a": "X"}})
     .replace('"X"', nested(1500)), ["body"]),
])
def test_ranges_no_float_holds_and_deep_json_are_422s_naming_the_field(live, path, body, loc):
    status, answer = post(live, path, body)
    assert status == 422 and answer["detail"][0]["loc"] == loc, answer
    assert live.server.poll() is None


def test_a_clients_idempotency_key_cannot_take_a_trials_place(live):
    with live.client() as c:
        nxt = c.get("/sweeps", params={"limit": 1}).json()
    following = (nxt["data"][0]["id"] if nxt["data"] else 0) + 1
    with live.client() as c:
        squat = c.post("/jobs", json=tiny_job(), headers={"Idempotency-Key": f"sweep-{following}-trial-0"}).json()
    status, made = post(live, "/sweeps", {"job": tiny_job(), "method": "random", "max_trials": 2, "max_concurrent": 2,
                                          "parameters": {"train.lr": {"type": "float", "low": 0.001, "high": 0.1}}})
    assert status == 201 and made["id"] == following
    deadline = time.monotonic() + 30
    while len(got := sweep(live, following)["trials"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    cancel_all(live, following)
    assert sorted(t["trial"] for t in got) == [0, 1] and squat["id"] not in [t["job_id"] for t in got]


def test_a_sweep_whose_search_fails_ends_failed_and_the_next_gets_its_trials(live):
    # Stored by the release before, which took it; every pass then raised, for every sweep after it.
    bad = {"job": tiny_job(), "method": "random", "max_trials": 3, "max_concurrent": 1, "seed": 0, "startup_trials": 10,
           "max_failed_trials": 5, "metric": "val_loss", "direction": None, "pruner": None, "name": None,
           "parameters": {"train.lr": {"type": "float", "low": 1e-300, "high": 1.7e308, "step": 1e-300, "log": False}}}
    broken = live.db.execute("INSERT INTO sweeps (state, spec, created_at, trial_count) VALUES ('running', ?, 0, 0) "
                             "RETURNING id", (json.dumps(bad),)).fetchone()[0]
    status, good = post(live, "/sweeps", {"job": tiny_job(), "method": "random", "max_trials": 2, "max_concurrent": 2,
                                          "parameters": {"train.lr": {"type": "float", "low": 0.001, "high": 0.1}}})
    assert status == 201
    deadline = time.monotonic() + 30
    while (sweep(live, good["id"])["trial_count"] < 2 or sweep(live, broken)["state"] == "running") \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    cancel_all(live, good["id"])
    failed = sweep(live, broken)
    assert failed["state"] == "failed" and "the search failed" in failed["error"], failed
    assert sweep(live, good["id"])["trial_count"] == 2
