"""The CLI for scripts: the real `trainyard` console script, run against the real server and a CPU worker with
its stdout and stderr pipes. Through a pipe nothing is wrapped or cut; under --json every answer parses and
every error, local ones too, is JSON on stderr with a non-zero exit; `result` and `metrics` read what a job
made; `download` offers every format the API serves; 422s name fields as the client wrote them."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import tiny_job
from trainyard.app.cli import build_parser
from trainyard.app.cli.output import STATE_STYLE, state_text
from trainyard.app.core.states import JobState

TRAINYARD = Path(sys.executable).with_name("trainyard")  # the console script pip installed
# Longer than any terminal's line, with spaces where a wrapper would break it.
LONG_NAME = ("a job name long enough that a terminal of 80 columns would wrap it, " * 2).strip()
IRIS_ROWS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]


def cli(svc, *args: str, url: str | None = None) -> subprocess.CompletedProcess:
    """`trainyard ARGS` with stdout and stderr pipes, where a shell's COLUMNS=80 would have wrapped Rich."""
    env = {k: v for k, v in svc.env.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    env.update(COLUMNS="80", TERM="xterm-256color", **({"TRAINYARD_URL": url} if url else {}))
    return subprocess.run([str(TRAINYARD), *args], env=env, capture_output=True, text=True, timeout=180)


def ok_json(r: subprocess.CompletedProcess):
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def json_error(r: subprocess.CompletedProcess) -> dict:
    """The one JSON error a failed command under --json wrote on stderr (its stdout empty)."""
    assert r.returncode != 0 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stderr)["error"]


def write(tmp_path: Path, name: str, body) -> str:
    path = tmp_path / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.slow  # starts the real server and a worker, and trains
def test_the_cli_under_json_and_through_a_pipe(live, tmp_path):
    job = ok_json(cli(live, "submit", write(tmp_path, "job.json", {**tiny_job(), "name": LONG_NAME}), "--wait",
                      "--json"))
    assert job["state"] == "succeeded" and job["name"] == LONG_NAME
    assert ok_json(cli(live, "status", str(job["id"]), "--json"))["id"] == job["id"]
    assert [j["id"] for j in ok_json(cli(live, "jobs", "--json"))["data"]] == [job["id"]]

    # People's output, through a pipe: each row whole on one line, nothing cut to "…".
    r = cli(live, "jobs")
    assert r.returncode == 0 and "…" not in r.stdout, r.stdout
    [row] = [line for line in r.stdout.splitlines() if LONG_NAME in line]
    assert job["created_at"][:19] in row and "succeeded" in row
    r = cli(live, "status", str(job["id"]))
    assert any(LONG_NAME in line for line in r.stdout.splitlines()), r.stdout

    # What the job made: its metrics per epoch and its result.
    metrics = ok_json(cli(live, "metrics", str(job["id"]), "--json"))
    assert [m["epoch"] for m in metrics] == [1, 2] and all("train_loss" in m for m in metrics)
    assert [m["epoch"] for m in ok_json(cli(live, "metrics", str(job["id"]), "--since", "1", "--json"))] == [2]
    rows = cli(live, "metrics", str(job["id"])).stdout.splitlines()
    assert "train_loss" in rows[1] and [line.split("│")[1].strip() for line in rows[3:5]] == ["1", "2"], rows
    assert "val_accuracy" in ok_json(cli(live, "result", str(job["id"]), "--json"))

    spec = {"kind": "predict", "model_job": job["id"], "inputs": IRIS_ROWS}
    predict = ok_json(cli(live, "submit", write(tmp_path, "predict.json", spec), "--wait", "--json"))
    result = ok_json(cli(live, "result", str(predict["id"]), "--json"))
    classes = [p["class"] for p in result["predictions"]]
    assert len(classes) == 2 and set(classes) <= set(result["class_names"])
    table = cli(live, "result", str(predict["id"])).stdout
    for i, cls in enumerate(classes):  # each prediction's row: its index, its class, the likeliest classes
        [line] = [line for line in table.splitlines() if line.startswith(f"│ {i} ")]
        assert line.split("│")[2].strip() == cls and line.split("│")[3].strip().startswith(cls), table

    # A job that fails is the answer, on stdout; stderr has nothing but errors of the CLI's own.
    failing = write(tmp_path, "failing.json", {**tiny_job(), "model": {"arch": "cifar_net"}})  # iris is no image
    for follow in ("--wait", "--follow"):
        r = cli(live, "submit", failing, follow, "--json")
        assert r.returncode == 1 and r.stderr == "" and json.loads(r.stdout)["state"] == "failed", r
    r = cli(live, "watch", str(json.loads(r.stdout)["id"]), "--json")
    assert r.returncode == 1 and r.stderr == "" and json.loads(r.stdout)["error"]["type"] == "JobError", r

    # Errors under --json: JSON on stderr, never text, and not 0.
    broken = write(tmp_path, "broken.json", '{"kind": "train",')
    assert "cannot read a JSON job from" in json_error(cli(live, "submit", broken, "--json"))["detail"]
    assert "cannot read a JSON sweep from" in json_error(cli(live, "sweep", str(tmp_path / "gone.json"),
                                                              "--json"))["detail"]
    missing = json_error(cli(live, "upload", str(tmp_path / "missing.csv"), "--json"))
    assert missing["status_code"] is None and "missing.csv" in missing["detail"]
    assert "--tail" in json_error(cli(live, "logs", str(job["id"]), "--tail", "0", "--json"))["detail"]
    assert "invalid int value" in json_error(cli(live, "status", "twelve", "--json"))["detail"]
    assert json_error(cli(live, "status", "999999", "--json"))["status_code"] == 404
    assert json_error(cli(live, "jobs", "--json", url="http://127.0.0.1:9"))["status_code"] == 0
    lr = json_error(cli(live, "submit", write(tmp_path, "bad.json", {**tiny_job(lr=-1)}), "--json"))
    assert lr["status_code"] == 422 and [d["loc"] for d in lr["detail"]] == [["body", "train", "lr"]]

    # The same without --json: text on stderr, one line however long, naming the field as written.
    r = cli(live, "submit", broken)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and broken in r.stderr, r.stderr
    r = cli(live, "submit", write(tmp_path, "bad.json", {**tiny_job(lr=-1)}))
    assert r.returncode == 1 and r.stderr.startswith("error 422: train.lr: "), r.stderr


@pytest.mark.slow
def test_sweep_tables_through_a_pipe(live, tmp_path):
    spec = {"name": LONG_NAME, "job": {**tiny_job(), "device": "cuda:7"}, "method": "grid",  # no worker takes it
            "parameters": {"train.weight_decay": {"type": "choice", "values": [0.0, 0.001]}}}
    sweep = ok_json(cli(live, "sweep", write(tmp_path, "sweep.json", spec), "--json"))
    with live.client() as c:
        live.wait_until(lambda: c.get(f"/sweeps/{sweep['id']}").json()["trials"], 60, "the sweep's trials")
    r = cli(live, "sweeps")
    [row] = [line for line in r.stdout.splitlines() if LONG_NAME in line]
    assert sweep["created_at"][:19].replace("T", " ") in row and "…" not in r.stdout, r.stdout
    r = cli(live, "sweep-status", str(sweep["id"]))
    assert "train.weight_decay" in r.stdout and "…" not in r.stdout, r.stdout
    assert ok_json(cli(live, "sweep-cancel", str(sweep["id"]), "--json"))["state"] == "cancelled"


@pytest.mark.slow
def test_download_offers_every_format_the_api_serves(live, tmp_path):
    with live.client() as c:
        api = c.get("/openapi.json").json()
    [param] = [p for p in api["paths"]["/jobs/{job_id}/artifact"]["get"]["parameters"] if p["name"] == "format"]
    [download] = [a for a in subcommands(build_parser())["download"]._actions if a.dest == "format"]
    assert sorted(download.choices or ()) == sorted(param["schema"]["enum"])

    job = live.submit(tiny_job())
    assert live.wait_state(job["id"])["state"] == "succeeded"
    out = tmp_path / "iris.torchscript.pt"
    got = ok_json(cli(live, "download", str(job["id"]), "--format", "torchscript", "-o", str(out), "--json"))
    assert got == {"path": str(out), "bytes": out.stat().st_size} and out.read_bytes()[:2] == b"PK"  # a zip
    assert json_error(cli(live, "download", str(job["id"]), "-o", str(tmp_path / "no" / "dir.pt"),
                          "--json"))["status_code"] is None  # a folder that is not there: said, not a traceback


@pytest.mark.slow
def test_422s_name_the_field_as_the_client_wrote_it(live):
    train = tiny_job()
    cases = [
        ("/jobs", {**train, "train": {**train["train"], "lr": -1}}, ["body", "train", "lr"]),
        ("/jobs", {**train, "model": {"arch": "mlp", "hidden": ["x"]}}, ["body", "model", "hidden", 0]),
        ("/jobs", {**train, "name": "a\x1b"}, ["body", "name"]),
        ("/jobs", {"kind": "predict", "model_job": 1, "inputs": "x"}, ["body", "inputs"]),
        ("/jobs", {"kind": "predict", "model_job": 1, "inputs": [[1, "a"]]}, ["body", "inputs", 0, 1]),
        ("/jobs", {"kind": "run", "entrypoint": "x", "config": 1}, ["body", "config"]),
        ("/sweeps", {"job": {**train, "train": {"lrr": 1}}, "method": "grid",
                     "parameters": {"train.lr": {"type": "choice", "values": [0.1]}}}, ["body", "job", "train", "lrr"]),
        ("/sweeps", {"job": train, "parameters": {"train.lr": {"type": "float", "low": "a", "high": 1}}},
         ["body", "parameters", "train.lr", "low"]),
    ]
    with live.client() as c:
        for path, body, loc in cases:
            r = c.post(path, json=body)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, (body, r.text)


def test_every_argument_has_help_and_every_state_a_colour():
    for name, sub in subcommands(build_parser()).items():
        for action in sub._actions:
            assert action.help, (name, action.dest)  # positionals, `up --host` and `--port` too
    assert all(state in STATE_STYLE for state in JobState)
    assert str(state_text("pruned").style) == "yellow" and str(state_text("failed (oom)").style) == "red"
