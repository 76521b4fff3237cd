"""Sweeps as users meet them: the real server and CPU workers over HTTP. Grid, TPE, median pruning,
a server restart in the middle of a sweep, cancel, the events stream and /metrics."""
import json
import statistics
import time
from datetime import datetime

import httpx
import pytest

from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import ROOT, Service, live_service
from tests.helpers.sweeps import start_sweep, wait_sweep
from trainyard.app.launcher import postgres_schema

pytestmark = pytest.mark.slow


live = live_service(workers=2)


def iris(epochs: int, **train) -> dict:
    return tiny_job(epochs=epochs, **train)


def test_a_grid_sweep_runs_every_combination_and_names_the_best(live):
    lrs, hidden = [0.002, 0.05], [[8], [16, 16]]
    made = start_sweep(live, name="grid", job=iris(10), method="grid", max_concurrent=2,
                       parameters={"train.lr": {"type": "choice", "values": lrs},
                                   "model.hidden": {"type": "choice", "values": hidden}})
    assert made["state"] == "running" and made["max_trials"] == 4 and made["direction"] == "minimize"
    # The events stream tells each trial's changes and ends when the sweep does.
    events = []
    with httpx.stream("GET", f"{live.url}/sweeps/{made['id']}/events", timeout=120) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line.split(":", 1)[1])))
                if name == "end":
                    break
    done = wait_sweep(live, made["id"])
    assert done["state"] == "succeeded" and done["counts"]["succeeded"] == 4 and done["trial_count"] == 4
    tried = sorted((json.dumps(t["params"]["train.lr"]), json.dumps(t["params"]["model.hidden"]))
                   for t in done["trials"])
    assert tried == sorted((json.dumps(a), json.dumps(b)) for a in lrs for b in hidden)
    best = min(done["trials"], key=lambda t: t["value"])
    assert done["best"] == {"trial": best["trial"], "job_id": best["job_id"], "params": best["params"],
                            "value": best["value"]}
    assert [t["best"] for t in done["trials"]].count(True) == 1 and best["best"]
    # Each trial is an ordinary job, tagged with its sweep, running the values it tried.
    with live.client() as c:
        for t in done["trials"]:
            job = c.get(f"/jobs/{t['job_id']}").json()
            assert job["sweep"] == {"id": made["id"], "trial": t["trial"], "params": t["params"]}
            assert job["spec"]["train"]["lr"] == t["params"]["train.lr"]
            assert job["spec"]["model"]["hidden"] == t["params"]["model.hidden"]
            assert job["result"]["val_loss"] == t["value"]
        assert {j["id"] for j in c.get("/jobs", params={"sweep": made["id"]}).json()["data"]} == \
            {t["job_id"] for t in done["trials"]}
        curves = c.get(f"/sweeps/{made['id']}/curves").json()
        assert all(len(t["points"]) == 10 for t in curves["trials"])
        assert [t["best"] for t in curves["trials"]].count(True) == 1
        assert made["id"] in [s["id"] for s in c.get("/sweeps").json()["data"]]
        assert 'trainyard_sweeps{state="succeeded"}' in c.get("/metrics").text
    assert [n for n, _ in events][-1] == "end" and events[-1][1] == {"id": made["id"], "state": "succeeded"}
    ended = {d["trial"] for n, d in events if n == "trial" and d["state"] == "succeeded"}
    assert ended == {0, 1, 2, 3}
    assert [d["state"] for n, d in events if n == "sweep"][-1] == "succeeded"


def test_tpe_keeps_to_max_concurrent_and_improves_on_its_random_start(live):
    seen = []
    made = start_sweep(live, job=iris(15, batch_size=16), method="tpe", max_trials=12, max_concurrent=2,
                       startup_trials=4, seed=3,
                       parameters={"train.lr": {"type": "float", "low": 1e-4, "high": 0.3, "log": True}})
    done = wait_sweep(live, made["id"], watch=lambda s: seen.append(s["counts"]["queued"] + s["counts"]["running"]))
    assert done["state"] == "succeeded" and done["counts"]["succeeded"] == 12
    assert max(seen) <= 2
    # From the jobs' own times: never more than two trials queued or running at once.
    trials = done["trials"]
    for t in trials:
        at = t["created_at"]
        alive = [u for u in trials if u["created_at"] <= at < (u["finished_at"] or "9")]
        assert len(alive) <= 2, (t, alive)
    values = [t["value"] for t in sorted(trials, key=lambda t: t["trial"])]
    assert min(values[4:]) < statistics.median(values[:4])
    assert statistics.median(values[-4:]) < statistics.median(values[:4])


def test_the_median_rule_prunes_a_clearly_bad_trial_before_its_last_epoch(live):
    epochs = 600
    made = start_sweep(live, job=iris(epochs, batch_size=8), method="grid", max_concurrent=1, seed=1,
                       parameters={"train.lr": {"type": "choice", "values": [0.05, 0.03, 1e-6]}},
                       pruner={"type": "median", "startup_trials": 1, "warmup_epochs": 5})
    freed_after = {}

    def watch(s):
        # The decision is the job's finished_at (the database clock: this host's); its worker lets it go
        # (SIGTERM, SIGKILL after a second's grace) and says so at its next heartbeat (0.5 s here).
        for t in s.get("trials") or []:
            if t["state"] == "pruned" and t["job_id"] not in freed_after:
                decided = datetime.fromisoformat(t["finished_at"]).timestamp()
                job_id = t["job_id"]
                with live.client() as c:
                    live.wait_until(lambda job_id=job_id: job_id not in {w["job_id"] for w in c.get("/workers").json()},
                                    10, "the pruned trial's worker let go")
                freed_after[t["job_id"]] = time.time() - decided
    done = wait_sweep(live, made["id"], watch=watch)
    # (With one finished trial the median is that trial: lr 0.03 may be pruned too, behind lr 0.05.)
    assert done["state"] == "succeeded" and done["counts"]["succeeded"] >= 1 and done["counts"]["pruned"] >= 1
    bad = next(t for t in done["trials"] if t["params"]["train.lr"] == 1e-6)
    assert bad["state"] == bad["failure"] == "pruned" and bad["epoch"] < epochs
    with live.client() as c:
        job = c.get(f"/jobs/{bad['job_id']}").json()
        assert job["state"] == "pruned" and job["error"]["class"] == "pruned" and "median" in job["error"]["message"]
        assert len(c.get(f"/jobs/{bad['job_id']}/metrics").json()) >= 6  # it keeps the metrics it reported
        # Its worker stopped the process within 2 s of the decision (the supervisor logs it).
        assert "process stopped" in c.get(f"/jobs/{bad['job_id']}/logs").text
        pruned_epoch = int(job["error"]["message"].split("epoch ")[1].split(":")[0])
        assert bad["epoch"] == pruned_epoch  # where its metrics end: nothing was recorded after
    assert freed_after and max(freed_after.values()) < 2.5, freed_after  # 2 s, plus the heartbeat's lag


def test_cancelling_a_sweep_stops_its_trials_and_makes_no_more(live):
    made = start_sweep(live, job=slow_job(epochs=500), method="random", max_trials=10, max_concurrent=2,
                       parameters={"train.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}})
    with live.client() as c:
        live.wait_until(lambda: c.get(f"/sweeps/{made['id']}").json()["counts"]["running"] == 2, 60, "two running")
        r = c.post(f"/sweeps/{made['id']}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        assert r.json()["counts"]["cancelled"] == 2
        ids = {t["job_id"] for t in r.json()["trials"]}
        cancelled = time.monotonic()
        live.wait_until(lambda: not ids & {w["job_id"] for w in c.get("/workers").json()}, 5, "workers let go")
        assert time.monotonic() - cancelled < 2.5
        time.sleep(1)
        after = c.get(f"/sweeps/{made['id']}").json()
        assert after["trial_count"] == 2 and after["state"] == "cancelled"
        assert c.post(f"/sweeps/{made['id']}/cancel").status_code == 409


@pytest.mark.postgres
def test_a_server_restart_in_the_middle_of_a_sweep_loses_nothing(tmp_path):
    """On PostgreSQL, where the driver is woken by LISTEN/NOTIFY and its lease is the database's: the harder of
    the two (on SQLite the same driver polls; this module's other sweeps run there, and a restart is the same code)."""
    with postgres_schema("sweep") as url:
        restart_mid_sweep(Service(tmp_path / "data", url))


def restart_mid_sweep(svc: Service) -> None:
    svc.start_server()
    try:
        svc.start_worker("cpu")
        made = start_sweep(svc, job=iris(300, batch_size=8), method="random", max_trials=6, max_concurrent=1,
                           parameters={"train.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}})
        with svc.client() as c:
            svc.wait_until(lambda: c.get(f"/sweeps/{made['id']}").json()["counts"]["succeeded"] >= 2, 60, "two done")
            before = c.get(f"/sweeps/{made['id']}").json()
        assert svc.server is not None
        svc.server.kill()
        svc.server.wait()
        assert before["state"] == "running" and before["trial_count"] < 6  # killed in the middle
        time.sleep(1)  # trials go on without the server; nothing new is asked meanwhile
        svc.start_server()
        done = wait_sweep(svc, made["id"])
        assert done["state"] == "succeeded" and done["counts"]["succeeded"] == 6
        assert sorted(t["trial"] for t in done["trials"]) == list(range(6))
        assert len({t["params"]["train.lr"] for t in done["trials"]}) == 6
        with svc.client() as c:
            assert c.get("/jobs", params={"sweep": made["id"]}).json()["count"] == 6
    finally:
        svc.stop()


def test_bad_sweeps_get_422_naming_the_field(live):
    job = iris(2)
    cases = [
        ({"parameters": {"train.lrr": {"type": "float", "low": 0.1, "high": 1}}}, ["parameters", "train.lrr"]),
        ({"parameters": {"model.activation": {"type": "int", "low": 1, "high": 2}}},
         ["parameters", "model.activation", "type"]),
        ({"parameters": {"train.lr": {"type": "choice", "values": []}}},
         ["parameters", "train.lr", "values"]),
        ({"method": "grid", "max_trials": 2,
          "parameters": {"train.lr": {"type": "choice", "values": [0.1, 0.2, 0.3]}}}, ["max_trials"]),
        ({"parameters": {"train.lr": {"type": "float", "low": 0.5, "high": 0.1}}}, ["parameters", "train.lr"]),
        ({"parameters": {"train.lr": {"type": "choice", "values": [0.1]}}, "metric": "nope"}, ["metric"]),
    ]
    with live.client() as c:
        for over, loc in cases:
            r = c.post("/sweeps", json={"job": job, **over})
            assert r.status_code == 422, (over, r.text)
            assert r.json()["detail"][0]["loc"][1:1 + len(loc)] == loc, (over, r.json())
        assert c.get("/sweeps/999999").status_code == 404


def test_a_run_job_sweeps_its_config_on_the_metrics_it_reports(live):
    """Your own training program (the example plugin's cifar_loop) is swept like a train job: paths into
    its config, the metric it reports with ctx.report, the direction from the metric."""
    job = {"kind": "run", "entrypoint": "cifar_loop", "device": "cpu", "config": {"epochs": 2, "size": 120}}
    made = start_sweep(live, job=job, method="grid", metric="val_accuracy",
                       parameters={"config.lr": {"type": "choice", "values": [0.001, 0.01]}})
    assert made["direction"] == "maximize"
    done = wait_sweep(live, made["id"])
    assert done["state"] == "succeeded" and done["counts"]["succeeded"] == 2
    assert done["best"]["value"] == max(t["value"] for t in done["trials"])
    with live.client() as c:
        for t in done["trials"]:
            assert c.get(f"/jobs/{t['job_id']}").json()["spec"]["config"] == {"epochs": 2, "size": 120,
                                                                             "lr": t["params"]["config.lr"]}


def test_the_readme_sweep_runs_as_written(live):
    section = (ROOT / "docs/sweeps.md").read_text().split("# Sweeps\n", 1)[1].split("\n## ", 1)[0]
    body = json.loads(section.split("cat > sweep.json <<'JSON'\n", 1)[1].split("\nJSON\n", 1)[0])
    done = wait_sweep(live, start_sweep(live, **body)["id"], timeout=300)
    assert done["state"] == "succeeded" and done["trial_count"] == 20
    assert sum(done["counts"].values()) == 20 and done["counts"]["failed"] == 0
    assert set(done["best"]["params"]) == set(body["parameters"])
