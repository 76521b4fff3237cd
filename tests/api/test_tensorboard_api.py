"""TensorBoard event files through the real service: GET /jobs/{id}/tensorboard's archive read back with TensorBoard's
own reader (a scalar per epoch per metric, as GET /jobs/{id}/metrics lists them, the learning rate, the HParams
plugin's hyperparameters) and held to the job's visibility; a sweep's trials each with their own hyperparameters,
downloaded by `trainyard tensorboard --sweep`; the files kept as long as the job's model (a reclaimed trial's go
with its model), counted in its project's storage, deleted with the job; a job SIGKILLed and resumed shows each
epoch once."""
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.helpers.jobs import slow_job, tiny_job
from tests.helpers.service import live_service, metrics
from tests.helpers.sweeps import start_sweep, wait_sweep

pytestmark = pytest.mark.slow  # the real server and worker, training
live = live_service(env={"TRAINYARD_COLLECT_GRACE_S": "0"}, team=True)
TRAINYARD = Path(sys.executable).with_name("trainyard")  # the console script pip installed
NOT_METRICS = {"epoch", "epochs", "attempt", "at", "recorded_at"}


def read_folder(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def unpacked(body: bytes, dest: Path) -> list[str]:
    """The archive's member names, unpacked into dest."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        names = tar.getnames()
        tar.extractall(dest, filter="data")
    return names


def hparams_of(acc: EventAccumulator) -> dict:
    content = acc.SummaryMetadata(hparams_metadata.SESSION_START_INFO_TAG).plugin_data.content
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


def close(stored: float, reported: float) -> bool:
    return abs(stored - reported) <= 1e-6 * max(1.0, abs(reported))


def same_as_metrics(acc: EventAccumulator, records: list[dict]) -> None:
    """Every number of every epoch record (GET /jobs/{id}/metrics) is the scalar of its name at step = epoch, and
    each scalar has one point per epoch that reported it."""
    names = {k for r in records for k, v in r.items() if isinstance(v, int | float) and k not in NOT_METRICS}
    assert {"train_loss", "val_loss", "val_accuracy", "lr"} <= names <= set(acc.Tags()["scalars"])
    for name in names:
        want = {r["epoch"]: r[name] for r in records if isinstance(r.get(name), int | float)}
        points = acc.Scalars(name)
        assert [s.step for s in points] == sorted(want), name
        assert all(close(s.value, want[s.step]) for s in points), (name, points, want)


def test_a_jobs_event_files_come_as_an_archive_tensorboard_reads(live, tmp_path):
    svc, team = live
    with team.client("ann") as ann:
        job = ann.post("/jobs", json=tiny_job(epochs=4, lr=0.01)).json()
        done = svc.wait_state(job["id"])
        assert done["state"] == "succeeded", done
        r = ann.get(f"/jobs/{job['id']}/tensorboard")
        assert r.status_code == 200, r.text
        assert r.headers["content-disposition"] == f'attachment; filename="job-{job["id"]}-tensorboard.tar.gz"'
        names = unpacked(r.content, tmp_path)
        assert names and all(n.startswith(f"{job['id']}/") and "tfevents" in n for n in names)
        acc = read_folder(tmp_path / str(job["id"]))
        same_as_metrics(acc, metrics(svc, job["id"]))
        assert [s.step for s in acc.Scalars("lr")] == [1, 2, 3, 4] and all(close(s.value, 0.01)
                                                                        for s in acc.Scalars("lr"))
        hp = hparams_of(acc)
        assert hp["train.lr"] == 0.01 and hp["train.epochs"] == 4 and hp["model.arch"] == "mlp"
        assert close(acc.Scalars("final/val_accuracy")[-1].value, done["result"]["val_accuracy"])
        missing = ann.get("/jobs/999999/tensorboard")
        assert missing.status_code == 404
    with team.client("ben") as ben:  # another project's job answers as a missing one
        hidden = ben.get(f"/jobs/{job['id']}/tensorboard")
        assert hidden.status_code == 404 and hidden.json()["detail"] == missing.json()["detail"].replace(
            "999999", str(job["id"]))
    with team.client("ada") as admin:
        assert admin.get(f"/jobs/{job['id']}/tensorboard").status_code == 200
        predict = admin.post("/jobs", json={"kind": "predict", "model_job": job["id"], "device": "cpu",
                                            "inputs": [[5.1, 3.5, 1.4, 0.2]]}).json()
        assert svc.wait_state(predict["id"])["state"] == "succeeded"
        none = admin.get(f"/jobs/{predict['id']}/tensorboard")
        assert none.status_code == 404 and "no TensorBoard event files" in none.json()["detail"]


def cli(svc, token: str, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**svc.env, "TRAINYARD_URL": svc.url, "TRAINYARD_API_TOKEN": token, "COLUMNS": "200"}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([str(TRAINYARD), "tensorboard", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def test_a_sweeps_trials_each_have_their_hparams_and_go_with_their_models(live, tmp_path):
    svc, team = live
    made = start_sweep(svc, job=tiny_job(epochs=3), method="random", max_trials=3, max_concurrent=1, keep_best=1,
                       parameters={"train.lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}})
    done = wait_sweep(svc, made["id"], timeout=300)
    with svc.client() as admin:
        trials = admin.get(f"/sweeps/{made['id']}/trials").json()
        assert [t["state"] for t in trials] == ["succeeded"] * 3
        r = cli(svc, team.tokens["ada"], "--sweep", str(made["id"]), "--dir", str(tmp_path / "tb"), "--no-launch",
                "--json")
        assert r.returncode == 0, r.stderr
        said = json.loads(r.stdout)
        assert sorted(said["jobs"]) == sorted(t["job_id"] for t in trials) and said["missing"] == {}
        assert said["command"] == ["tensorboard", "--logdir", str(tmp_path / "tb")]
        for t in trials:  # a run per trial, each with the value it tried and a point per epoch
            acc = read_folder(tmp_path / "tb" / str(t["job_id"]))
            assert close(hparams_of(acc)["train.lr"], t["params"]["train.lr"])
            assert [s.step for s in acc.Scalars("val_loss")] == [1, 2, 3]
        # The sweep has ended: keep_best=1 reclaims the others' models at the collector's pass, their event files too.
        assert admin.post("/storage/collect").status_code == 200
        best = done["best"]["job_id"]
        for t in trials:
            kept = t["job_id"] == best
            assert admin.get(f"/jobs/{t['job_id']}/tensorboard").status_code == (200 if kept else 404)
            assert (svc.data_dir / "tensorboard" / str(t["job_id"])).exists() == kept
            assert admin.get(f"/jobs/{t['job_id']}/artifact").status_code == (200 if kept else 410)  # its model too


def stored_files(data_dir: Path, job_id: int) -> list[Path]:
    """A succeeded job's objects in the data directory: its model, its event files and its log."""
    return [p for folder in ("artifacts", "tensorboard") for p in (data_dir / folder / str(job_id)).rglob("*")
            if p.is_file()] + [data_dir / "logs" / f"{job_id}.log"]


def test_event_files_count_in_the_projects_storage_and_go_with_the_job(live, tmp_path):
    svc, team = live
    with team.client("ben") as ben, svc.client() as admin:
        job = ben.post("/jobs", json=tiny_job(epochs=3)).json()
        assert svc.wait_state(job["id"])["state"] == "succeeded"
        events = svc.data_dir / "tensorboard" / str(job["id"])

        def measured_as_listed() -> bool:  # the log may take the worker's last line after the job's end
            assert admin.post("/storage/collect").status_code == 200
            files = stored_files(svc.data_dir, job["id"])
            return ben.get("/storage").json()["project"] == {
                "name": "beta", "bytes": sum(p.stat().st_size for p in files), "objects": len(files)}

        svc.wait_until(measured_as_listed, 30, "beta's storage to count the job's files, its event files among them")
        assert any("tfevents" in p.name for p in events.iterdir())  # referenced: kept with the job's model
        # Without --no-launch and with no tensorboard on PATH: the folder and the command are said instead.
        r = cli(svc, team.tokens["ben"], str(job["id"]), "--dir", str(tmp_path / "tb"), path="/usr/bin:/bin")
        assert r.returncode == 0, r.stderr
        assert f"tensorboard --logdir {tmp_path / 'tb'}" in r.stdout and "not installed" in r.stdout
        assert any("tfevents" in p.name for p in (tmp_path / "tb" / str(job["id"])).iterdir())
        assert ben.delete(f"/jobs/{job['id']}").status_code == 204
        assert not events.exists()


def test_a_job_killed_and_resumed_shows_each_epoch_once(service):
    first = service.start_worker("cpu")
    # A checkpoint at epoch 15 only: a kill after epoch 16 loses epochs that the resumed run reports again. The
    # kill must land within epochs 16-29 (under a second on a fast machine; 5 epochs were too few to be sure of).
    job = service.submit(slow_job(epochs=30, checkpoint_every=15))
    service.wait_until(lambda: service.job(job["id"])["checkpoint_epoch"] == 15
                       and len(metrics(service, job["id"])) >= 16, 240, "epoch 16, past the checkpoint of epoch 15")
    os.kill(first.pid, signal.SIGKILL)
    service.start_worker("cpu")
    done = service.wait_state(job["id"], timeout=300)
    assert done["state"] == "succeeded" and done["runs"] == 2, done
    assert done["result"]["resumed_from_epoch"] == 15
    folder = service.data_dir / "tensorboard" / str(job["id"])
    killed, resumed = sorted(folder.iterdir(), key=lambda p: p.name.rpartition(".run-")[2])  # a file per claim
    assert killed.name.endswith(".run-1") and resumed.name.endswith(".run-2")
    assert max(s.step for s in read_folder(killed).Scalars("train_loss")) > 15  # epochs lost, and run again
    acc = read_folder(folder)
    assert [s.step for s in acc.Scalars("train_loss")] == list(range(1, 31))  # each epoch once
    same_as_metrics(acc, metrics(service, job["id"]))  # the first run's numbers up to its checkpoint, the second's on
