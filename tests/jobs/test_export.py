"""GET /jobs/{id}/artifact?format=onnx|pt2|torchscript against a live service: the exported files take a
predict job's raw `inputs` rows and give its probabilities, are made once and then served from the
store, and refuse what cannot be exported cleanly."""
import concurrent.futures
import io
import json
import re
import warnings
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from tests.helpers.docs import run_block
from tests.helpers.jobs import tiny_job
from tests.helpers.service import ROOT, Service

pytestmark = pytest.mark.slow  # starts the real server and a worker, trains, exports in subprocesses

IRIS_ROWS = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]]
# FakeData's raw inputs: 0..255 per pixel, channels first, flattened (3 x 32 x 32).
IMAGE_ROWS = np.random.default_rng(0).integers(0, 256, size=(3, 3 * 32 * 32)).tolist()
IMAGE_JOB = {"kind": "train", "model": {"arch": "cifar_net"}, "data": {"dataset": "fake", "size": 64},
             "train": {"epochs": 1, "batch_size": 32}, "device": "cpu"}
# Pixels of 0..16 (digits' own scaling) into a CNN with batch norm, which must export in eval mode.
DIGITS_JOB = {"kind": "train", "model": {"arch": "cnn", "channels": [4, 8]}, "data": {"dataset": "digits"},
              "train": {"epochs": 1, "batch_size": 64}, "device": "cpu"}
DIGITS_ROWS = np.random.default_rng(1).integers(0, 17, size=(4, 64)).tolist()


@pytest.fixture(scope="module")
def models(live):
    """{name: (train job id, input rows, the predict job's probabilities for those rows)}, plus the iris
    predict job's id and a spare iris model's."""
    jobs = {"iris": (tiny_job(), IRIS_ROWS), "image": (IMAGE_JOB, IMAGE_ROWS), "digits": (DIGITS_JOB, DIGITS_ROWS)}
    trained = {name: live.submit(body)["id"] for name, (body, _) in jobs.items()}
    spare = live.submit(tiny_job())["id"]
    predicted = {}
    for name, (_, rows) in jobs.items():
        assert live.wait_state(trained[name])["state"] == "succeeded"
        predicted[name] = live.submit({"kind": "predict", "model_job": trained[name], "inputs": rows})["id"]
    out = {}
    with live.client() as c:
        for name, (_, rows) in jobs.items():
            assert live.wait_state(predicted[name])["state"] == "succeeded"
            result = c.get(f"/jobs/{predicted[name]}/result").json()
            out[name] = (trained[name], rows, np.array([p["probabilities"] for p in result["predictions"]]))
    assert live.wait_state(spare)["state"] == "succeeded"
    return {**out, "predict_job": predicted["iris"], "spare": spare}


def download(live, job_id: int, fmt: str) -> bytes:
    with live.client(timeout=120) as c:
        r = c.get(f"/jobs/{job_id}/artifact", params={"format": fmt})
    assert r.status_code == 200, r.text
    assert f'filename="job-{job_id}-model.' in r.headers["content-disposition"]
    return r.content


def run_exported(fmt: str, blob: bytes, rows) -> np.ndarray:
    x = np.asarray(rows, dtype=np.float32)
    if fmt == "onnx":
        session = onnxruntime.InferenceSession(blob, providers=["CPUExecutionProvider"])
        return session.run(["probabilities"], {"input": x})[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated upstream
        model = torch.export.load(io.BytesIO(blob)).module() if fmt == "pt2" else torch.jit.load(io.BytesIO(blob))
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def run_dir(live, job_id: int):
    (found,) = (live.data_dir / "artifacts" / str(job_id)).glob("run-*")
    return found


# Each export takes a few seconds (a subprocess that imports torch): TorchScript, deprecated upstream, on one model.
@pytest.mark.parametrize("name,fmt", [("iris", "onnx"), ("iris", "pt2"), ("iris", "torchscript"),
                                      ("image", "onnx"), ("image", "pt2"), ("digits", "onnx")])
def test_export_gives_the_predict_jobs_probabilities(live, models, name, fmt):
    job_id, rows, want = models[name]
    blob = download(live, job_id, fmt)
    got = run_exported(fmt, blob, rows)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # The batch dimension is dynamic: the export's example had 2 rows, the predict jobs 3 or 4, here 1.
    np.testing.assert_allclose(run_exported(fmt, blob, rows[:1]), want[:1], rtol=0, atol=1e-5)


def test_second_request_is_served_from_the_store(live, models):
    job_id = models["iris"][0]
    first = download(live, job_id, "onnx")
    cached = run_dir(live, job_id) / "model.onnx"
    before = cached.stat()
    second = download(live, job_id, "onnx")
    after = cached.stat()
    assert first == second == cached.read_bytes()
    # Not exported again: a new export would have renamed a new file into place.
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_concurrent_first_requests_get_whole_files(live, models):
    job_id, rows, want = models["digits"]
    (run_dir(live, job_id) / "model.pt2").unlink(missing_ok=True)  # so that every request below is a first one
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        blobs = list(pool.map(lambda _: download(live, job_id, "pt2"), range(4)))
    assert all(b == blobs[0] for b in blobs)
    np.testing.assert_allclose(run_exported("pt2", blobs[0], rows), want, rtol=0, atol=1e-5)
    assert not [p.name for p in run_dir(live, job_id).iterdir() if p.name.startswith(".")]  # no temp files left


def test_exports_are_kept_in_the_bucket(tmp_path, bucket):
    """With TRAINYARD_STORAGE_URL a bucket, the worker on a disk of its own (another host): the API fetches
    the artifact from the bucket, exports it, publishes the file there, and streams the bucket's copy after."""
    svc = Service(tmp_path / "api", f"sqlite:///{tmp_path / 'jobs.db'}",
                  env={**bucket.env, "TRAINYARD_STORAGE_URL": bucket.url}).start_server()
    try:
        svc.start_worker("cpu", env={"TRAINYARD_DATA_DIR": str(tmp_path / "worker")})
        job_id = svc.submit(tiny_job())["id"]
        assert svc.wait_state(job_id)["state"] == "succeeded"
        first = download(svc, job_id, "onnx")
        (key,) = [k for k in bucket.keys() if k.startswith(f"trainyard/artifacts/{job_id}/") and k.endswith(".onnx")]
        (local,) = (tmp_path / "api" / "artifacts" / str(job_id)).glob("run-*/model.onnx")
        local.unlink()  # the API host's copy: without it, only the bucket's can answer (or a new export)
        assert download(svc, job_id, "onnx") == first
        assert not local.exists() and key in bucket.keys()
        assert run_exported("onnx", first, IRIS_ROWS).shape == (3, 3)
    finally:
        svc.stop()


def test_unknown_format_is_refused_naming_it(live, models):
    with live.client() as c:
        r = c.get(f"/jobs/{models['iris'][0]}/artifact", params={"format": "tflite"})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", "format"]


def test_jobs_without_a_model_are_refused(live, models):
    with live.client() as c:
        r = c.get(f"/jobs/{models['predict_job']}/artifact", params={"format": "onnx"})
        assert r.status_code == 404 and "predict job" in r.json()["detail"]
        assert c.get("/jobs/424242/artifact", params={"format": "onnx"}).status_code == 404
        queued = live.submit({**tiny_job(), "device": "cuda:7"})["id"]  # no worker here takes it
        r = c.get(f"/jobs/{queued}/artifact", params={"format": "pt2"})
        assert r.status_code == 409 and "queued" in r.json()["detail"]


def test_what_cannot_be_exported_is_a_clear_error(live, models):
    job_id = models["spare"]
    meta_file = run_dir(live, job_id) / "meta.json"
    meta = meta_file.read_text()
    # As a run job's ctx.save_model(model) leaves it: weights, but nothing that says how to rebuild the model.
    meta_file.write_text(json.dumps({"format": 1, "meta": {}, "precision": "fp32"}))
    with live.client(timeout=120) as c:
        r = c.get(f"/jobs/{job_id}/artifact", params={"format": "pt2"})
        assert r.status_code == 409 and f"job {job_id} cannot be exported" in r.json()["detail"], r.text
        assert "arch" in r.json()["detail"]
        meta_file.write_text(meta)
        (run_dir(live, job_id) / "model.safetensors").write_bytes(b"not a safetensors file")
        r = c.get(f"/jobs/{job_id}/artifact", params={"format": "onnx"})
        assert r.status_code == 500
        detail = r.json()["detail"]
        assert f"exporting job {job_id} to onnx failed" in detail and "SafetensorError" in detail, detail
        assert c.get("/healthz").status_code == 200  # the server is fine
        # Remembered beside the artifact: asked again, the same answer without another export process.
        children = children_cpu_seconds(live.server.pid)
        r = c.get(f"/jobs/{job_id}/artifact", params={"format": "onnx"})
        assert r.status_code == 500 and r.json()["detail"] == detail
        assert children_cpu_seconds(live.server.pid) == children
    made = [p.name for p in run_dir(live, job_id).iterdir() if p.name.startswith((".", "model.onnx", "model.pt2"))]
    assert made == ["model.onnx.failed"]


def children_cpu_seconds(pid: int) -> int:
    """The CPU time (clock ticks) of the children a process has waited for: its export subprocesses."""
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[13]) + int(fields[14])


def test_readme_export_section(live, models, tmp_path):
    """The README's example, as written: job 1 is this service's iris model too."""
    job_id, rows, want = models["iris"]
    assert job_id == 1 and rows[:2] == [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]
    section = (ROOT / "docs/training.md").read_text().split("\n## Exporting a model\n", 1)[1].split("\n## ", 1)[0]
    (curl, onnx_example, torch_example) = re.findall(r"```(sh|python)\n(.*?)```", section, re.S)
    r = run_block(*curl[:1], curl[1].replace("localhost:8000", live.url.removeprefix("http://")), tmp_path)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"iris.onnx", "iris.pt2", "iris.torchscript.pt"}
    r = run_block(*onnx_example, tmp_path)
    assert r.returncode == 0, r.stderr
    names = ["setosa", "versicolor", "virginica"]
    assert r.stdout.strip() == str([names[i] for i in want[:2].argmax(axis=1)])
    r = run_block(*torch_example, tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("tensor([["), r.stderr
