"""Hosts that share only PostgreSQL and a bucket: no file of one host's disk is read by another.

Three processes with data directories of their own stand for three hosts: the API, worker A and
worker B, each with its own TRAINYARD_NODE_NAME. The bucket is on the tests' own S3 server (moto's).
"""
import os
import signal

import pytest
import safetensors.torch

from tests.helpers.data import iris_csv
from tests.helpers.jobs import IRIS_JOB, slow_job
from tests.helpers.service import Service, metrics, wait_checkpoint
from trainyard.app.launcher import postgres_schema

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def files_under(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def host(tmp_path, name: str) -> dict:
    return {"TRAINYARD_DATA_DIR": str(tmp_path / name), "TRAINYARD_NODE_NAME": name}


def test_a_job_killed_on_one_host_resumes_on_another_from_the_bucket(tmp_path, bucket):
    with postgres_schema("hosts") as db_url:
        api = Service(tmp_path / "api", db_url, env={**bucket.env, "TRAINYARD_STORAGE_URL": bucket.url,
                                                     "TRAINYARD_NODE_NAME": "api"}).start_server()
        try:
            with api.client() as c:
                r = c.post("/datasets", files={"file": ("iris.csv", iris_csv())}, data={"label_column": "species"})
            assert r.status_code == 201, r.text
            upload = r.json()
            assert f"trainyard/datasets/uploads/{upload['id']}/data.npz" in bucket.keys()

            a = api.start_worker("cpu", env=host(tmp_path, "host-a"))
            job = api.submit(slow_job(epochs=20))  # 18 epochs left for the kill to land in
            wait_checkpoint(api, job["id"], 2)
            os.kill(a.pid, signal.SIGKILL)
            killed = api.job(job["id"])
            assert [k for k in bucket.keys() if k.startswith(f"trainyard/checkpoints/{job['id']}/")
                    and f"-e{killed['checkpoint_epoch']:05d}-" in k], bucket.keys()
            assert files_under(tmp_path / "host-b") == []  # host B has never seen any file of this job

            api.start_worker("cpu", env=host(tmp_path, "host-b"))
            done = api.wait_state(job["id"], timeout=240)
            assert done["state"] == "succeeded" and done["runs"] == 2, done
            resumed = done["result"]["resumed_from_epoch"]
            assert resumed is not None and resumed >= killed["checkpoint_epoch"]
            assert [m["epoch"] for m in metrics(api, job["id"])] == list(range(1, 21))
            # Host B resumed from the bucket's copy of host A's checkpoint; the job's checkpoints are
            # deleted from the bucket once it has succeeded.
            assert not [k for k in bucket.keys() if k.startswith(f"trainyard/checkpoints/{job['id']}/")]

            with api.client() as c:
                log = c.get(f"/jobs/{job['id']}/logs").text
                art = c.get(f"/jobs/{job['id']}/artifact")
                # The uploaded dataset, trained on and predicted from on host B, from the bucket.
                tiny = api.submit({**IRIS_JOB, "data": {"dataset": upload["dataset"]}, "device": "cpu"})
                assert api.wait_state(tiny["id"])["state"] == "succeeded"
                pred = api.submit({"kind": "predict", "model_job": tiny["id"],
                                   "data": {"dataset": upload["dataset"], "split": "all"}})
                assert api.wait_state(pred["id"])["state"] == "succeeded"
                rows = c.get(f"/jobs/{pred['id']}/result").json()
            # One log, both hosts' runs: host B went on with what host A had published.
            assert "on host-a-" in log and "on host-b-" in log and "resumed from checkpoint" in log, log
            assert art.status_code == 200 and art.headers["content-length"] == str(len(art.content))
            state = safetensors.torch.load(art.content)
            assert state and all(t.isfinite().all() for t in state.values())
            assert rows["samples"] == 150 and rows["accuracy"] > 0.8, rows  # result.json, from the bucket
            # The API served all of it from the bucket: no job's file is on its disk (the upload it received is,
            # as its cache).
            assert not [f for f in files_under(tmp_path / "api") if f.split("/")[0] in
                        ("artifacts", "checkpoints", "logs")], files_under(tmp_path / "api")
        finally:
            api.stop()


def test_a_run_taken_over_leaves_the_next_runs_log_in_the_bucket_as_it_was(tmp_path, bucket):
    # The bucket holds one log a job. Host A's supervisor is stopped past its lease (its job process runs on);
    # host B takes the job over and finishes it; then host A wakes, finds the job no longer its own and ends
    # its run, whose log it must not publish over host B's.
    with postgres_schema("hosts_log") as db_url:
        api = Service(tmp_path / "api", db_url, env={**bucket.env, "TRAINYARD_STORAGE_URL": bucket.url,
                                                     "TRAINYARD_NODE_NAME": "api"}).start_server()
        a = None
        try:
            a = api.start_worker("cpu", env=host(tmp_path, "host-a"))
            job = api.submit(slow_job(epochs=16))  # host A must still be running it when it is stopped
            wait_checkpoint(api, job["id"], 1)
            os.kill(a.pid, signal.SIGSTOP)
            api.start_worker("cpu", env=host(tmp_path, "host-b"))
            done = api.wait_state(job["id"], timeout=240)
            assert done["state"] == "succeeded" and done["runs"] == 2, done
            with api.client() as c:
                taken_over = c.get(f"/jobs/{job['id']}/logs").text
            assert "on host-a-" in taken_over and "on host-b-" in taken_over, taken_over

            os.kill(a.pid, signal.SIGCONT)
            a_log = tmp_path / "host-a" / "logs" / f"{job['id']}.log"
            api.wait_until(lambda: "is no longer ours" in a_log.read_text(), 60, "host A to stop its copy")
            with api.client() as c:
                api.wait_until(lambda: not [w for w in c.get("/workers").json()
                                            if w["host"] == "host-a" and w["job_id"] is not None], 30, "host A to idle")
                assert c.get(f"/jobs/{job['id']}/logs").text == taken_over
        finally:
            if a is not None and a.poll() is None:
                os.kill(a.pid, signal.SIGCONT)
            api.stop()
