"""What lists and a job's own reports may cost the server, done for real against a live server: the
dashboard's list poll over big predict jobs (response bytes, the server's peak memory from /proc),
how many bytes a predict job's spec takes in the database, a page of metrics, and what a run job may
report or save (refused in the job process, and again by its supervisor when the job's code goes
around trainyard.Context)."""
import json
import re
import sqlite3
import time
from pathlib import Path

import pytest

from tests.helpers.processes import peak_rss, reset_peak
from tests.helpers.service import probe_plugin, run_job, serving
from trainyard.app.api.routes.jobs import NEXT_SINCE
from trainyard.app.spec import MAX_METRIC_KEYS, MAX_METRIC_NAME

pytestmark = pytest.mark.slow
MiB = 1 << 20
LIST_BYTES = 1 * MiB  # the service's TRAINYARD_MAX_LIST_BYTES here: a few 1 MB specs are past it
APP_JS = Path(__file__).parents[2] / "app" / "api" / "static" / "app.js"

PROBES = '''
import json

import torch


def loud(ctx, config):
    """Reports what config asks: epochs records of `keys` metrics named `name_len` characters."""
    for epoch in range(1, config["epochs"] + 1):
        ctx.report(epoch, **{f"{i:0{config['name_len']}d}": float(i) for i in range(config["keys"])})
    return {"ok": True}


def around(ctx, config):
    """Sends an epoch record past the bounds straight down the pipe, as code that skips ctx.report could."""
    ctx._job.emit({"type": "epoch", "epoch": 1, **{f"m{i}": 1.0 for i in range(config["keys"])}})
    return {"ok": True}


def meta(ctx, config):
    """save_model with `blob` bytes of extra meta, or (raw) a meta.json of that size written by hand."""
    model = torch.nn.Linear(4, 3)
    if config.get("raw"):
        ctx.save_model(model)
        path = ctx._job.artifact_dir / "meta.json"
        saved = json.loads(path.read_text())
        path.write_text(json.dumps({**saved, "blob": "x" * config["blob"]}))
    else:
        ctx.save_model(model, blob="x" * config["blob"])
    return {"ok": True}
'''


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Path:
    return probe_plugin(tmp_path_factory.mktemp("probes"), "trainyard_list_probes", PROBES, ("loud", "around", "meta"))


@pytest.fixture(scope="module")
def live(probes, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("lists") / "data", env={"TRAINYARD_MAX_LIST_BYTES": str(LIST_BYTES)},
                 worker_env={"PYTHONPATH": str(probes)}) as svc:
        yield svc


def test_the_dashboards_list_poll_over_big_predict_jobs_is_bounded(live):
    model = live.submit({"kind": "train", "model": {"arch": "mlp", "hidden": [8]}, "device": "cpu",
                         "data": {"dataset": "fake", "size": 50, "image_size": [1, 16, 16], "num_classes": 2},
                         "train": {"epochs": 1, "batch_size": 32}})
    assert live.wait_state(model["id"])["state"] == "succeeded"
    for w in live.workers:  # the predict jobs stay queued: only their specs matter here
        w.terminate()
        w.wait()
    live.workers.clear()
    # 1 MB bodies of whole numbers: stored as 0.0 with spaces, each was a 2.5 MB spec.
    body = json.dumps({"kind": "predict", "model_job": model["id"], "inputs": [[0] * 256] * 1970},
                      separators=(",", ":")).encode()
    with live.client(timeout=60) as c:
        ids = [c.post("/jobs", content=body, headers={"content-type": "application/json"}).json()["id"]
               for _ in range(6)]
        with sqlite3.connect(live.data_dir / "trainyard.db") as db:
            stored = db.execute("SELECT max(length(spec)) FROM jobs WHERE kind = 'predict'").fetchone()[0]
        assert stored <= len(body) * 1.01, (stored, len(body))

        poll = re.search(r'api\("(/jobs\?limit=100[^"]*)"\)', APP_JS.read_text()).group(1)
        assert "spec" not in poll, poll  # the dashboard never asks for whole specs in a list
        pid = live.server.pid
        time.sleep(0.5)
        reset_peak(pid)
        base = peak_rss(pid)
        r = c.get(poll)
        assert r.status_code == 200 and len(r.content) < 64 << 10, len(r.content)
        items = {j["id"]: j for j in r.json()["data"]}
        assert items[ids[0]]["summary"] == {"model_job": model["id"], "rows": 1970}
        assert items[model["id"]]["summary"] == {"arch": "mlp", "dataset": "fake"}

        # Whatever include asks, a page holds about TRAINYARD_MAX_LIST_BYTES and says where the rest starts.
        r = c.get("/jobs?limit=100&include=spec,result,errors")
        page = r.json()
        assert r.status_code == 200 and len(r.content) <= LIST_BYTES + (64 << 10), len(r.content)
        assert page["truncated"] and page["next_offset"] == len(page["data"]) < page["count"] == 7
        assert page["data"][0]["spec"]["inputs"][0][:2] == [0, 0]
        seen = [j["id"] for j in page["data"]]
        while page["next_offset"] is not None:
            page = c.get(f"/jobs?limit=100&include=spec&offset={page['next_offset']}").json()
            seen += [j["id"] for j in page["data"]]
        assert seen == sorted([*ids, model["id"]], reverse=True)
        grown = peak_rss(pid) - base
        assert grown < 100 * MiB, grown / MiB  # was 2.5 GB for a hundred such jobs

        # GET /jobs/{id} still has the inputs (as sent: whole numbers), and its summary.
        job = c.get(f"/jobs/{ids[0]}").json()
        assert len(job["spec"]["inputs"]) == 1970 and job["summary"]["rows"] == 1970


@pytest.fixture
def working(live, probes):
    """The live service with a worker (the list test stops them)."""
    if not live.workers:
        live.start_worker("cpu", env={"PYTHONPATH": str(probes)})
    return live


def test_a_report_past_the_bounds_fails_the_job_naming_the_limit(working):
    live = working
    cases = {"keys": (run_job("loud", epochs=1, keys=MAX_METRIC_KEYS + 1, name_len=4), f"limit of {MAX_METRIC_KEYS}"),
             "name": (run_job("loud", epochs=1, keys=1, name_len=MAX_METRIC_NAME + 1), f"limit is {MAX_METRIC_NAME}"),
             "around": (run_job("around", keys=500), f"limit of {MAX_METRIC_KEYS}")}
    jobs = {k: live.submit(spec)["id"] for k, (spec, _) in cases.items()}
    for k, (_, says) in cases.items():
        done = live.wait_state(jobs[k], timeout=60)
        assert done["state"] == "failed" and done["error"]["class"] == "job", done
        assert says in done["error"]["message"], done["error"]
    with live.client() as c:  # the supervisor stored none of the record it refused
        assert c.get(f"/jobs/{jobs['around']}/metrics").json() == []


def test_metrics_come_in_pages_of_bounded_bytes(working):
    live = working
    # 100 epochs of 100 metrics named 100 characters: 1.3 MB, past the page's 1 MiB.
    job = live.wait_state(live.submit(run_job("loud", epochs=100, keys=100, name_len=100))["id"], timeout=90)
    assert job["state"] == "succeeded", job
    assert len(json.dumps(job["latest_metrics"])) < 16 << 10
    with live.client() as c:
        r = c.get(f"/jobs/{job['id']}/metrics")
        assert r.status_code == 200 and len(r.content) <= LIST_BYTES + (16 << 10)
        first = r.json()
        since = int(r.headers[NEXT_SINCE])
        assert since == first[-1]["epoch"] < 100
        rest = c.get(f"/jobs/{job['id']}/metrics", params={"since": since})
        assert NEXT_SINCE not in rest.headers
        assert [m["epoch"] for m in first + rest.json()] == list(range(1, 101))
        small = c.get(f"/jobs/{job['id']}/metrics", params={"since": 10, "limit": 5})
        assert [m["epoch"] for m in small.json()] == [11, 12, 13, 14, 15] and small.headers[NEXT_SINCE] == "15"


def test_save_model_with_big_meta_is_refused(working):
    live = working
    refused = live.wait_state(live.submit(run_job("meta", blob=100_000))["id"], timeout=60)
    assert refused["state"] == "failed" and refused["error"]["class"] == "job", refused
    assert "64 KiB" in refused["error"]["message"], refused["error"]
    # Code that writes meta.json itself: its supervisor refuses the job, and no predict job reads the file.
    raw = live.wait_state(live.submit(run_job("meta", blob=2 * MiB, raw=True))["id"], timeout=60)
    assert raw["state"] == "failed" and raw["error"]["class"] == "job", raw
    assert "meta.json" in raw["error"]["message"] and "1 MiB" in raw["error"]["message"], raw["error"]
