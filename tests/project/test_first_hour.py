"""A new user's first hour (issue 38), tried as they would: the README's commands and files, the CLI off a terminal,
what a submit answers, a finished job's event stream, a cancelled job's log, a misspelt field."""
import json
import re
import subprocess
import sys

import pytest

from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import ROOT
from trainyard.app.client import DEPRECATED, Client

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
served = pytest.mark.slow  # the tests of the module's service (a server and a CPU worker); the docs' are quick


def cli(live, *args: str) -> subprocess.CompletedProcess:
    """The `trainyard` command as a script runs it: output through pipes, not a terminal."""
    return subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, env=live.env, capture_output=True,
                          text=True, timeout=120)


def padded(text: str) -> list[str]:
    return [line for line in text.splitlines() if line != line.rstrip()]


# -- the CLI ---------------------------------------------------------------------------------------

@served
def test_the_example_job_runs_through_the_cli_and_no_line_is_padded(live):
    r = cli(live, "submit", "examples/job.json", "--wait")  # as the README says, from the checkout
    assert r.returncode == 0, r.stderr
    assert "succeeded" in r.stdout and "iris-mlp" in r.stdout
    job_id = re.search(r"^ *id +(\d+)$", r.stdout, re.M).group(1)
    status = cli(live, "status", job_id)
    assert status.returncode == 0 and '"val_accuracy"' in status.stdout
    # The table's longest value (the result, hundreds of characters) once padded every line to its width.
    assert padded(r.stdout) == padded(r.stderr) == padded(status.stdout) == []


@served
def test_devices_on_a_host_without_a_gpu_shows_no_none(live):
    r = cli(live, "devices")
    assert r.returncode == 0, r.stderr
    assert "CUDA available: False" in r.stdout and " idle" in r.stdout
    assert "None" not in r.stdout  # was "driver None" and "idle job None"


@served
def test_a_misspelt_field_names_the_one_meant(live, tmp_path):
    job = tiny_job()
    job["train"]["epcohs"] = job["train"].pop("epochs")
    with live.client() as c:
        r = c.post("/jobs", json=job)
        assert r.status_code == 422
        assert r.json()["detail"] == [{"loc": ["body", "train", "epcohs"], "type": "extra_forbidden",
                                       "msg": "Extra inputs are not permitted; did you mean `epochs`?"}]
        top = c.post("/jobs", json={**tiny_job(), "modle": {}}).json()["detail"][0]
        assert top["loc"] == ["body", "modle"] and top["msg"].endswith("did you mean `model`?")
        predict = c.post("/jobs/batch", json=[tiny_job(), {"kind": "predict", "model_job": "$0", "inptus": [[1.0]]}])
        assert predict.json()["detail"][0]["msg"].endswith("did you mean `inputs`?")
        far = c.post("/jobs", json={**tiny_job(), "zzzzzz": 1}).json()["detail"][0]
        assert far["msg"] == "Extra inputs are not permitted"  # nothing close: no guess
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(job))
    r = cli(live, "submit", str(spec))
    assert r.returncode == 1 and "did you mean `epochs`?" in r.stderr


# -- the API ---------------------------------------------------------------------------------------

@served
def test_a_submit_answers_what_the_job_waits_for(live):
    with live.client() as c:
        first = c.post("/jobs", json={**tiny_job(), "device": "cuda:0"}).json()  # no worker takes it: it stays queued
        try:
            after = c.post("/jobs", json={**tiny_job(), "after": [first["id"]]})
            assert after.status_code == 201
            assert f"job {first['id']} (queued)" in after.json()["waiting_for"]
            assert after.json()["waiting_for"] == c.get(f"/jobs/{after.json()['id']}").json()["waiting_for"]
            batch = c.post("/jobs/batch", json=[{**tiny_job(), "device": "cuda:0"},
                                                {"kind": "predict", "model_job": "$0", "inputs": [[1, 2, 3, 4]]}])
            assert batch.status_code == 201
            head, predict = batch.json()
            assert f"job {head['id']} (queued)" in predict["waiting_for"]
        finally:
            c.post(f"/jobs/{first['id']}/cancel")  # its dependents fail with it


@served
def test_a_finished_jobs_stream_opens_as_its_run_began_and_is_followed_in_order(live, capsys):
    from trainyard.app.cli.job_output import follow_lines
    job = live.wait_state(live.submit(tiny_job(epochs=5))["id"])
    assert job["state"] == "succeeded"
    with Client(live.url) as client:
        events = list(client.jobs.events(job["id"]))
        opening = events[0]
        assert opening["event"] == "state" and opening["data"]["state"] == "running"
        # Not the ended run's epoch 5 (nor its finish): the run's epochs come after.
        assert opening["data"]["progress"] == {"epoch": 0, "epochs": 5}
        assert opening["data"]["latest_metrics"] is None and opening["data"]["finished_at"] is None
        assert [e["data"]["epoch"] for e in events if e["event"] == "epoch"] == [1, 2, 3, 4, 5]
        # `submit --wait` follows the stream: its lines go forward, never back to epoch 1 after epoch 5.
        follow_lines(client, job["id"], quiet=False)
    epochs = [int(n) for n in re.findall(r"epoch (\d+)/5", capsys.readouterr().err)]
    assert epochs == sorted(epochs) and epochs[-1] == 5, epochs


@served
def test_a_cancelled_jobs_log_says_it_was_cancelled(live):
    job = live.submit(slow_job(epochs=200))
    live.wait_until(lambda: (live.job(job["id"])["progress"]["epoch"] or 0) >= 1, 60, "its first epoch")
    with live.client() as c:
        assert c.post(f"/jobs/{job['id']}/cancel").status_code == 200
        live.wait_until(lambda: "no longer ours" in c.get(f"/jobs/{job['id']}/logs").text, 30, "its worker to stop it")
        assert "job is no longer ours (cancelled by request): process stopped" in c.get(f"/jobs/{job['id']}/logs").text


# -- the README and the docs -----------------------------------------------------------------------

def test_the_readme_says_where_the_command_and_the_pages_are():
    quick = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert ".venv/bin/trainyard" in quick and "source .venv/bin/activate" in quick
    assert "http://127.0.0.1:8000/ " in quick and "`/healthz`" in quick and "`/docs`" in quick


def test_the_files_the_docs_submit_exist():
    named = {(page.name, f) for page in PAGES for f, rest in
             re.findall(r"trainyard submit ([\w./-]+\.json)(.*)$", page.read_text(), re.M)
             if not re.search(r"#\s*\{", rest)}  # a line whose comment shows the job's JSON: an outline, not a file
    assert ("README.md", "examples/job.json") in named
    assert [n for n in named if not (ROOT / n[1]).is_file()] == []
    spec = json.loads((ROOT / "examples/job.json").read_text())
    assert spec["kind"] == "train" and spec["data"]["dataset"] == "iris"


def test_the_readme_deletes_no_job_the_training_docs_use_later():
    readme, training = (ROOT / "README.md").read_text(), (ROOT / "docs/training.md").read_text()
    deleted = set(re.findall(r"trainyard delete (\d+)", readme))
    used = set(re.findall(r"/jobs/(\d+)/|\"(?:init_from|model_job)\": (\d+)", training))
    used_ids = {i for pair in used for i in pair if i}
    assert deleted and "1" in used_ids and deleted.isdisjoint(used_ids), (deleted, used_ids)


def test_the_docs_say_one_thing_of_the_dashboards_token_and_use_no_deprecated_call():
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"local ?storage", text, re.I), page.name  # it is an HttpOnly cookie (docs/teams.md)
        flat = re.findall(rf"\b(?:Client|client|c)\.({'|'.join(DEPRECATED)})\(", text)
        assert flat == [], (page.name, flat)
