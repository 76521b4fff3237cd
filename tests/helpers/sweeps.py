"""Sweeps for the tests: started and waited for over a live service's API, or driven in-process by
being the worker (run_trial)."""
import time

from tests.helpers.jobs import tiny_job
from trainyard.app.jobs import queue
from trainyard.app.spec import SweepSpec


def start_sweep(svc, **body) -> dict:
    """POST /sweeps with body: the sweep made (201)."""
    r = svc.client().post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def wait_sweep(svc, sweep_id: int, timeout: float = 120, watch=None) -> dict:
    """The sweep once ended with none of its trials queued or running; watch sees each reading."""
    deadline = time.monotonic() + timeout
    with svc.client() as c:
        while time.monotonic() < deadline:
            s = c.get(f"/sweeps/{sweep_id}").json()
            if watch:
                watch(s)
            if s["state"] != "running" and not (s["counts"]["queued"] or s["counts"]["running"]):
                return s
            time.sleep(0.1)
    raise AssertionError(f"sweep {sweep_id} still running after {timeout} s: {s}")


def sweep_spec(**over) -> SweepSpec:
    body = {"job": tiny_job(epochs=4), "method": "random", "max_trials": 4, "max_concurrent": 2,
            "parameters": {"train.lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}}, **over}
    return SweepSpec.model_validate(body)


def run_trial(engine, losses: list[float], finish: bool = True):
    """Be the worker: claim the next job, report an epoch per loss, succeed with the last."""
    job = queue.claim(engine, "w", "cpu", 30)
    assert job is not None and job.sweep is not None
    epochs = [(i + 1, {"train_loss": v, "val_loss": v, "val_accuracy": 0.5}) for i, v in enumerate(losses)]
    queue.record_progress(engine, job.id, job.claim, epochs)
    if finish:
        queue.succeed(engine, job.id, job.claim, {"val_loss": losses[-1], "val_accuracy": 0.5,
                                                  "train_loss": losses[-1]}, None)
    return job
