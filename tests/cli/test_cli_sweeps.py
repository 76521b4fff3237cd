"""The CLI's sweep commands (sweep [--follow], sweeps, sweep-status, sweep-watch, sweep-cancel) against the
real server and CPU workers, and how a sweep's trials are drawn."""
import io
import json
import subprocess
import sys
import time

import pytest
from rich.console import Console

from tests.helpers.service import ROOT, live_service
from trainyard.app.cli import sweep_output
from trainyard.app.spec import TRAIN_EXAMPLE

IRIS = {**TRAIN_EXAMPLE, "train": {**TRAIN_EXAMPLE["train"], "epochs": 3}}
LRS = [0.001, 0.01, 0.1]


def grid(name: str, **kw) -> dict:
    """A grid sweep over three learning rates of the README's Iris job, 3 epochs a trial."""
    return {"name": name, "job": IRIS, "method": "grid", "metric": "val_loss", "max_concurrent": 2,
            "parameters": {"train.lr": {"type": "choice", "values": LRS}}, **kw}


live = live_service(workers=2)


def cli(svc, *args, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, env={**svc.env, "COLUMNS": "200"},
                          capture_output=True, text=True, input=input, timeout=timeout)


def write(tmp_path, spec: dict) -> str:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(spec))
    return str(path)


def by_name(svc, name: str) -> dict:
    with svc.client() as c:
        page = c.get("/sweeps", params={"limit": 200}).raise_for_status().json()
        [found] = [s for s in page["data"] if s["name"] == name]
        return c.get(f"/sweeps/{found['id']}").raise_for_status().json()


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of a rich table in text, by their first cell (a trial's number, a sweep's id)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].isdigit():
            rows[cells[0]] = cells
    return rows


def best_line(sweep: dict) -> str:
    b = sweep["best"]
    return (f"best trial {b['trial']} (job {b['job_id']}): {sweep['metric']} {b['value']:.4g}  "
            f"train.lr={b['params']['train.lr']:.4g}")


@pytest.mark.slow
def test_sweep_follow_shows_the_trials_then_the_best_and_exits_0(live, tmp_path):
    r = cli(live, "sweep", write(tmp_path, grid("follow")), "--follow")
    assert r.returncode == 0, r.stderr
    sweep = by_name(live, "follow")
    assert sweep["state"] == "succeeded" and len(sweep["trials"]) == 3
    trials = sweep["trials"]
    best = min(trials, key=lambda t: t["value"])
    assert sweep["best"]["trial"] == best["trial"] and sweep["best"]["value"] == best["value"]
    assert r.stdout.strip() == best_line(sweep)  # stdout: the answer only; the live table is on stderr
    rows = table_rows(r.stderr)
    assert set(rows) == {str(t["trial"]) for t in trials}
    for t in trials:  # trial, job, state, train.lr, val_loss, epoch, best
        assert rows[str(t["trial"])] == [str(t["trial"]), str(t["job_id"]), "succeeded",
                                         f"{t['params']['train.lr']:.4g}", f"{t['value']:.4g}", "3/3",
                                         "*" if t["trial"] == best["trial"] else ""]
    assert sorted(t["params"]["train.lr"] for t in trials) == LRS
    assert "succeeded" in r.stderr.splitlines()[0] and "3/3 trials" in r.stderr


@pytest.mark.slow
def test_sweep_from_stdin_follow_json_is_the_ended_sweep(live):
    r = cli(live, "sweep", "-", "--follow", "--json", input=json.dumps(grid("stdin-json")))
    assert r.returncode == 0, r.stderr
    sweep = json.loads(r.stdout)
    assert sweep["id"] == by_name(live, "stdin-json")["id"] and sweep["state"] == "succeeded"
    assert [(t["state"], t["epoch"], t["epochs"]) for t in sweep["trials"]] == [("succeeded", 3, 3)] * 3
    assert sweep["best"]["params"]["train.lr"] in LRS


@pytest.mark.slow
def test_sweeps_lists_it_and_sweep_status_shows_its_trials(live):
    with live.client() as c:
        made = c.post("/sweeps", json=grid("listed")).raise_for_status().json()
    r = cli(live, "sweep-watch", str(made["id"]))
    assert r.returncode == 0, r.stderr
    sweep = by_name(live, "listed")
    listing = cli(live, "sweeps")
    assert listing.returncode == 0, listing.stderr
    row = table_rows(listing.stdout)[str(sweep["id"])]  # id, name, state, method, metric, trials, counts, best, created
    assert row[:7] == [str(sweep["id"]), "listed", "succeeded", "grid", "val_loss (minimize)", "3/3", "3 succeeded"]
    assert row[7] == f"{sweep['best']['value']:.4g} (trial {sweep['best']['trial']})"
    page = json.loads(cli(live, "sweeps", "--json").stdout)
    assert sweep["id"] in [s["id"] for s in page["data"]] and page["count"] >= 1
    running = cli(live, "sweeps", "--state", "running", "--json")
    assert sweep["id"] not in [s["id"] for s in json.loads(running.stdout)["data"]]

    status = cli(live, "sweep-status", str(sweep["id"]))
    assert status.returncode == 0, status.stderr
    rows = table_rows(status.stdout)
    assert {r[3] for r in rows.values()} == {f"{lr:.4g}" for lr in LRS}
    assert [n for n, r in rows.items() if r[-1] == "*"] == [str(sweep["best"]["trial"])]
    assert best_line(sweep) in status.stdout
    assert json.loads(cli(live, "sweep-status", str(sweep["id"]), "--json").stdout)["trials"] == sweep["trials"]


@pytest.mark.slow
def test_a_bad_path_is_refused_naming_the_field(live, tmp_path):
    bad = grid("bad", parameters={"train.lrr": {"type": "choice", "values": LRS}})
    r = cli(live, "sweep", write(tmp_path, bad), "--follow")
    assert r.returncode == 1 and "error 422" in r.stderr and "train.lrr" in r.stderr, r.stderr
    r = cli(live, "sweep", write(tmp_path, bad), "--json")
    assert r.returncode == 1 and r.stdout == ""
    error = json.loads(r.stderr)["error"]
    assert error["status_code"] == 422 and any("train.lrr" in map(str, d["loc"]) for d in error["detail"])
    with live.client() as c:
        assert "bad" not in [s["name"] for s in c.get("/sweeps").json()["data"]]
    r = cli(live, "sweep-status", "9999")
    assert r.returncode == 1 and "error 404" in r.stderr


@pytest.mark.slow
def test_cancel_ends_a_following_sweep_with_exit_1(live, tmp_path):
    long = {**grid("cancelled"), "method": "random", "max_trials": 50, "max_concurrent": 1,
            # The longest a trial may be (about 5 s): trial 0 is still running when the cancel, a new process, lands.
            "job": {**IRIS, "train": {**IRIS["train"], "epochs": 10_000}},
            "parameters": {"train.lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}}}
    follow = subprocess.Popen([sys.executable, "-m", "trainyard", "sweep", write(tmp_path, long), "--follow"],
                              cwd=ROOT, env={**live.env, "COLUMNS": "200"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with live.client() as c:
                names = {s["name"]: s for s in c.get("/sweeps", params={"limit": 200}).json()["data"]}
            if names.get("cancelled", {}).get("counts", {}).get("running"):
                break
            time.sleep(0.2)
        sweep_id = names["cancelled"]["id"]
        r = cli(live, "sweep-cancel", str(sweep_id))
        assert r.returncode == 0 and "cancelled" in r.stdout.splitlines()[0], r.stderr
        _, errs = follow.communicate(timeout=60)
    finally:
        follow.kill()
    assert follow.returncode == 1 and f"sweep {sweep_id} was cancelled" in errs
    assert "cancelled" in table_rows(errs)["0"][2]  # its running trial's job was cancelled with it
    again = cli(live, "sweep-cancel", str(sweep_id))
    assert again.returncode == 1 and "error 409" in again.stderr


@pytest.mark.slow
def test_a_sweep_whose_trials_fail_exits_1_saying_why(live, tmp_path):
    failing = grid("failing", job={**IRIS, "model": {"arch": "cifar_net"}}, max_failed_trials=1)  # iris is not images
    r = cli(live, "sweep", write(tmp_path, failing), "--follow")
    sweep = by_name(live, "failing")
    assert sweep["state"] == "failed"
    assert r.returncode == 1 and f"sweep {sweep['id']} failed" in r.stderr
    assert "failed (job)" in [row[2] for row in table_rows(r.stderr).values()]
    assert r.stdout.strip() == f"sweep {sweep['id']} failed without a best trial"


def test_an_unreadable_file_exits_2_before_any_request(tmp_path):
    (tmp_path / "sweep.json").write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "trainyard", "sweep", str(tmp_path / "sweep.json"),
                        "--url", "http://127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read a JSON sweep" in r.stderr


def test_the_trials_table_shows_pruned_failed_and_the_best():
    sweep = {"id": 4, "name": "t", "state": "running", "method": "tpe", "metric": "val_accuracy",
             "direction": "maximize", "max_trials": 8, "trial_count": 4,
             "counts": {"running": 1, "succeeded": 1, "pruned": 1, "failed": 1},
             "best": {"trial": 0, "job_id": 10, "params": {"model.hidden": [16, 16], "train.lr": 0.012345},
                      "value": 0.9},
             "spec": {"parameters": {"train.lr": {}, "model.hidden": {}}}}
    trial = {"job_id": None, "params": {}, "value": None, "epoch": None, "epochs": None, "best": False}
    trials = [{**trial, "trial": 2, "job_id": 12, "state": "failed", "failure": "pruned", "value": 0.5, "epoch": 2,
               "epochs": 10, "params": {"train.lr": 0.1, "model.hidden": [8]}},
              {**trial, "trial": 0, "job_id": 10, "state": "succeeded", "value": 0.9, "epoch": 10, "epochs": 10,
               "params": {"train.lr": 0.012345, "model.hidden": [16, 16]}},
              {**trial, "trial": 3, "job_id": 13, "state": "running", "value": 0.7, "epoch": 4, "epochs": 10,
               "params": {"train.lr": 0.001, "model.hidden": [8]}, "best": True},  # the sweep's best wins
              {**trial, "trial": 1, "job_id": 11, "state": "failed", "failure": "job", "params": {"train.lr": 3.0}}]
    con = Console(record=True, width=200, file=io.StringIO())
    con.print(sweep_output.sweep_view(sweep, trials))
    text = con.export_text()
    assert text.splitlines()[0] == ("sweep 4 t  running  tpe  4/8 trials (1 succeeded, 1 pruned, 1 failed, 1 running)"
                                    "  val_accuracy (maximize): best 0.9 (trial 0)")
    assert list(table_rows(text).values()) == [  # trial, job, state, train.lr, model.hidden, val_accuracy, epoch, best
        ["0", "10", "succeeded", "0.01235", "[16,16]", "0.9", "10/10", "*"],
        ["1", "11", "failed (job)", "3", "-", "-", "-", ""],
        ["2", "12", "pruned", "0.1", "[8]", "0.5", "2/10", ""],
        ["3", "13", "running", "0.001", "[8]", "0.7", "4/10", ""]]
    con = Console(record=True, width=200, file=io.StringIO())
    sweep_output.console, saved = con, sweep_output.console
    try:
        sweep_output.say_best(sweep)
    finally:
        sweep_output.console = saved
    assert con.export_text().strip() == ("best trial 0 (job 10): val_accuracy 0.9  "
                                         "model.hidden=[16,16], train.lr=0.01235")
