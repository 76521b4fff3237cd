"""The OpenAPI document as validators and generators take it: valid OpenAPI 3.1 (openapi-spec-validator), and a
client generated from it (openapi-python-client, offline) that drives the real server and worker through a
job's life, an upload and a sweep, with and without a token, parsing every answer (errors included) into its
declared model; the answers are also checked against the document's schemas. Every module the generator writes
imports (one operation with two media types once generated a module that did not)."""
import importlib
import io
import json
import pkgutil
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import pytest
from openapi_spec_validator import validate

from tests.helpers.jobs import tiny_job
from tests.helpers.openapi import conforms
from tests.helpers.service import TERMINAL, serving
from trainyard.app.fleet import devices_payload, nvml

TOKEN = "s3cret-openapi"
# Each route's operation id: generated clients name their methods by it, so a change breaks their users.
OPERATIONS = {
    ("post", "/jobs"): "submit_job", ("get", "/jobs"): "list_jobs", ("get", "/jobs/{job_id}"): "get_job",
    ("post", "/jobs/{job_id}/cancel"): "cancel_job", ("post", "/jobs/{job_id}/retry"): "retry_job",
    ("get", "/jobs/{job_id}/metrics"): "job_metrics", ("get", "/jobs/{job_id}/events"): "job_events",
    ("get", "/jobs/{job_id}/result"): "job_result", ("get", "/jobs/{job_id}/artifact"): "job_artifact",
    ("get", "/jobs/{job_id}/logs"): "job_logs",
    ("post", "/sweeps"): "submit_sweep", ("get", "/sweeps"): "list_sweeps", ("get", "/sweeps/{sweep_id}"): "get_sweep",
    ("get", "/sweeps/{sweep_id}/trials"): "sweep_trials", ("get", "/sweeps/{sweep_id}/curves"): "sweep_curves",
    ("post", "/sweeps/{sweep_id}/cancel"): "cancel_sweep", ("get", "/sweeps/{sweep_id}/events"): "sweep_events",
    ("post", "/datasets"): "upload_dataset", ("get", "/datasets"): "list_datasets",
    ("get", "/datasets/{dataset_id}"): "get_dataset", ("delete", "/datasets/{dataset_id}"): "delete_dataset",
    ("get", "/devices"): "list_devices", ("get", "/metrics"): "prometheus_metrics", ("get", "/catalog"): "catalog",
    ("get", "/workers"): "list_workers", ("post", "/workers/{worker_id}/drain"): "drain_worker",
    ("post", "/workers/{worker_id}/undrain"): "undrain_worker", ("get", "/healthz"): "healthz",
    ("get", "/storage"): "get_storage", ("post", "/storage/collect"): "collect_storage",
    ("get", "/me"): "whoami", ("get", "/admin/users"): "list_users", ("post", "/admin/users"): "add_user",
    ("get", "/admin/projects"): "list_projects", ("post", "/admin/projects"): "add_project",
    ("patch", "/admin/projects/{name}"): "update_project",
    ("put", "/admin/projects/{name}/members/{user}"): "add_member",
    ("delete", "/admin/projects/{name}/members/{user}"): "remove_member",
    ("post", "/admin/users/{name}/tokens"): "issue_token", ("delete", "/admin/tokens/{token_id}"): "revoke_token",
    ("get", "/admin/audit"): "list_audit",
    ("patch", "/admin/users/{name}"): "update_user", ("delete", "/admin/users/{name}"): "delete_user",
    ("post", "/session"): "sign_in", ("post", "/session/form"): "sign_in_form", ("delete", "/session"): "sign_out",
}
ERROR = {"$ref": "#/components/schemas/ErrorPublic"}


@pytest.fixture(scope="module")
def open_service(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("openapi") / "data", workers=1,
                 env={"TRAINYARD_MAX_UPLOAD_BYTES": str(1 << 20)}) as svc:
        yield svc


@pytest.fixture(scope="module")
def document(open_service):
    return httpx.get(f"{open_service.url}/openapi.json").json()


@pytest.fixture(scope="module")
def api(document, tmp_path_factory):
    """The client openapi-python-client generates from the served document (as the package `ty_api`)."""
    root = tmp_path_factory.mktemp("generated")
    (root / "openapi.json").write_text(json.dumps(document))
    (root / "config.yaml").write_text("post_hooks: []\n")  # no ruff formatting of the generated code
    r = subprocess.run([sys.executable, "-m", "openapi_python_client", "generate", "--path", "openapi.json",
                        "--output-path", "ty_api", "--meta", "none", "--config", "config.yaml"],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Warning" not in r.stdout + r.stderr, r.stdout + r.stderr
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("ty_api")
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "ty_api" or m.startswith("ty_api.")]:
            del sys.modules[name]


@pytest.mark.slow  # 12 s generating the client: the full suite's, not the quick loop's
def test_every_generated_module_imports(api):
    modules = [m.name for m in pkgutil.walk_packages(api.__path__, "ty_api.")]
    assert "ty_api.api.session.sign_in" in modules and "ty_api.api.jobs.job_result" in modules
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # every module's failure, named
            failed[name] = repr(e)
    assert not failed, failed


def test_the_document_is_valid_openapi_3_1_and_says_what_the_server_does(document):
    validate(document)
    assert "itemSchema" not in json.dumps(document)  # OpenAPI 3.2's, refused by 3.1 validators
    ops = {(m, p): o for p, methods in document["paths"].items() for m, o in methods.items()}
    assert {key: o["operationId"] for key, o in ops.items() if key in OPERATIONS} == OPERATIONS
    for (method, path), op in ops.items():
        assert op["operationId"].isidentifier() and op["operationId"].islower(), op["operationId"]
        assert op.get("security", [{}, {"HTTPBearer": []}]) == [{}, {"HTTPBearer": []}], path
        for status, response in op["responses"].items():
            if int(status) >= 400:  # every error is JSON, whatever the success's media type
                assert response["content"] == {"application/json": {"schema": ERROR}}, (path, status)
            for media in response.get("content", {}).values():
                assert media.get("schema"), (path, status)  # no answer left untyped
        shared = {"503"} | ({"400"} if path != "/healthz" else set()) | ({"403", "413", "507"} if method != "get"
                                                                          else set())
        assert shared <= set(op["responses"]), (method, path)
    assert ops[("get", "/healthz")].get("security") is None
    for (method, path), op in ops.items():  # admins only: documented
        if path.startswith("/admin/") or path.endswith("drain") or path == "/storage/collect":
            assert "not an admin" in op["responses"]["403"]["description"], (method, path)
    for op_id in ("list_devices", "catalog", "healthz", "job_result", "sweep_curves"):
        op = next(o for o in ops.values() if o["operationId"] == op_id)
        assert "$ref" in op["responses"]["200"]["content"]["application/json"]["schema"], op_id
    for (method, path), op in ops.items():  # one media type an operation: generators make one body argument
        assert len(op.get("requestBody", {"content": [None]})["content"]) == 1, (method, path)
    schemas = document["components"]["schemas"]
    # A job's whole result: typed by kind, no discriminator (nothing in it says its kind), the free-form last.
    kinds = [ref["$ref"].rsplit("/", 1)[1] for ref in schemas["FullJobResult"]["anyOf"]]
    assert kinds == ["PredictionResult", "EvaluationResult", "TrainResult", "RunResult"]
    assert "predictions" in schemas["PredictionResult"]["required"] and "epochs" in schemas["TrainResult"]["required"]
    assert "confusion_matrix" in schemas["EvaluationResult"]["required"]
    upload = schemas["Body_upload_dataset"]["properties"]["file"]
    assert upload["type"] == "string" and upload["format"] == "binary"
    assert schemas["SweepPublic"]["properties"]["state"] == {"$ref": "#/components/schemas/SweepState"}
    assert "epochs" in schemas["EpochMetrics"]["properties"]  # MetricPublic's base
    job = schemas["JobPublic"]["properties"]
    assert job["spec"]["oneOf"] and job["error"]["anyOf"][0] == {"$ref": "#/components/schemas/JobErrorPublic"}
    assert {"$ref": "#/components/schemas/EpochMetrics"} in job["latest_metrics"]["anyOf"]


def test_devices_of_gpu_hosts_conform(document):
    """/devices as GPU hosts answer it (readings shaped like NVML's, as tests/worker/test_devices.py records them): this
    machine has no GPU to show, the document must still type them."""
    from tests.helpers.gpu_readings import BUILD, CPU, H100, L4, on, worker

    nv = [{**H100, "nvml_index": i, "uuid": f"GPU-{i}"} for i in range(2)]
    mig = [{**H100, "uuid": "MIG-0", "mig_parent": "GPU-9", "utilization_gpu": None, "index": 0}]
    unreadable = {**{k: None for k in nvml.GPU_FIELDS}, "nvml_index": 3, "problem": "NVML could not read it: x"}
    workers = [worker("w0", "cuda:0", 1000.0, torch={"memory_allocated": 1}), worker("wc", "cpu", 999.0, job=None),
               on("gpu-b", "wb0", "cuda:0", 1000.0, [{**L4, "uuid": "GPU-b0", "index": 0}], "GPU-b0", job=4),
               on("gpu-c", "wm", "cuda:0", 1000.0, mig, "MIG-0"), on("gpu-d", "lost", "cuda:5", 1.0, [])]
    for readings in (nv, [*nv, unreadable], None):
        payload = devices_payload.build_payload(readings, workers, 1001.0, BUILD, CPU, 15)
        assert payload["cuda_devices"]
        conforms(document, "list_devices", 200, json.loads(json.dumps(payload)))


def test_the_body_limit_answers_in_json(open_service):
    with open_service.client() as c:
        for content in (b"x" * (2 << 20), iter([b"[" + b"1," * (1 << 20) + b"1]"])):  # announced, then streamed
            r = c.post("/jobs", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.headers["content-type"] == "application/json", r.text
            assert "TRAINYARD_MAX_BODY_BYTES" in r.json()["detail"][0]["msg"]
        # An upload's own, larger limit, past which its route answers before reading the file.
        r = c.post("/datasets", files={"file": ("big.csv", b"1" * (3 << 20))}, data={"label_column": "c"})
        assert r.status_code == 413 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["detail"][0]["loc"] == ["body"] and "TRAINYARD_MAX_UPLOAD_BYTES" in r.text


def wait(client, job_id: int):
    """The job (a generated JobPublic) once it has ended."""
    from ty_api.api.jobs import get_job
    return _until(lambda: get_job.sync(job_id, client=client), lambda job: job.state.value in TERMINAL)


@pytest.fixture
def client(api, open_service):
    with api.Client(base_url=open_service.url, timeout=60) as client:  # no token: this server has none
        yield client


@pytest.mark.slow
def test_a_generated_client_drives_the_service(api, client, document, open_service):
    from ty_api.api.datasets import get_dataset, upload_dataset
    from ty_api.api.jobs import cancel_job, get_job, job_artifact, job_logs, job_metrics, submit_job
    from ty_api.api.sweeps import cancel_sweep, get_sweep, submit_sweep, sweep_curves
    from ty_api.api.system import catalog, healthz, list_devices, list_workers
    from ty_api.models import BodyUploadDataset, ErrorPublic, JobState, PredictJob, SweepSpec, SweepState, TrainJob
    from ty_api.types import File

    made = submit_job.sync_detailed(client=client, body=TrainJob.from_dict(tiny_job(epochs=3)))
    assert made.status_code == 201
    job = wait(client, made.parsed.id)
    assert job.state == JobState.SUCCEEDED and job.spec.model.arch == "mlp" and job.latest_metrics.epoch == 3
    assert job.result.additional_properties["val_accuracy"] >= 0
    metrics = job_metrics.sync(job.id, client=client)
    assert [m.epoch for m in metrics] == [1, 2, 3] and all(m.epochs == 3 and m.train_loss > 0 for m in metrics)
    assert not metrics[0].additional_properties.keys() & {"epoch", "epochs", "attempt", "train_loss", "lr"}

    predict = submit_job.sync(client=client, body=PredictJob.from_dict(
        {"kind": "predict", "model_job": job.id, "inputs": [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]}))
    assert wait(client, predict.id).state == JobState.SUCCEEDED
    evaluate = submit_job.sync(client=client, body=PredictJob.from_dict(
        {"kind": "predict", "model_job": job.id, "data": {"dataset": "iris", "split": "val"}}))
    assert wait(client, evaluate.id).state == JobState.SUCCEEDED
    results_are_typed(client, job.id, predict.id, evaluate.id)
    assert b"" != job_artifact.sync(job.id, client=client).payload.read()
    assert "epoch" in job_logs.sync(job.id, client=client)

    csv = "a,b,c\n" + "".join(f"{i},{i % 3},{'xy'[i % 2]}\n" for i in range(20))
    data = upload_dataset.sync(client=client, body=BodyUploadDataset(
        file=File(payload=io.BytesIO(csv.encode()), file_name="two.csv"), label_column="c"))
    assert data.samples == 20 and data.classes == ["x", "y"]
    assert get_dataset.sync(data.id, client=client).dataset == f"upload:{data.id}"

    sweep = submit_sweep.sync(client=client, body=SweepSpec.from_dict({
        # Six trials one at a time: five are still to run when the first has ended, so the cancel below
        # always finds the sweep running (with two, the second could end first: a 409).
        "job": tiny_job(), "parameters": {"train.lr": {"type": "choice", "values": [0.01, 0.02, 0.05, 0.1, 0.2, 0.5]}},
        "method": "grid", "metric": "val_loss", "max_trials": 6, "max_concurrent": 1}))
    assert sweep.state == SweepState.RUNNING
    first = _until(lambda: get_sweep.sync(sweep.id, client=client), lambda s: s.trials)
    wait(client, first.trials[0].job_id)
    curves = sweep_curves.sync(sweep.id, client=client)
    assert curves.metric == "val_loss" and curves.trials[0].points
    assert cancel_sweep.sync(sweep.id, client=client).state == SweepState.CANCELLED

    queued = submit_job.sync(client=client, body=TrainJob.from_dict({**tiny_job(), "device": "cuda:7"}))
    cancelled = cancel_job.sync(queued.id, client=client)
    assert cancelled.state == JobState.CANCELLED and cancelled.error.class_.value == "cancelled"
    again = cancel_job.sync_detailed(queued.id, client=client)
    assert again.status_code == 409 and isinstance(again.parsed, ErrorPublic)
    for missing in (get_job.sync_detailed(424242, client=client), job_logs.sync_detailed(424242, client=client)):
        assert missing.status_code == 404 and isinstance(missing.parsed, ErrorPublic)
        assert "424242" in missing.parsed.detail
    bad = job_metrics.sync_detailed(job.id, client=client, limit=0)
    assert bad.status_code == 422 and bad.parsed.detail[0].loc == ["query", "limit"]

    assert healthz.sync(client=client).status == "ok"
    assert list_devices.sync(client=client).cpu.workers[0].device == "cpu"
    assert "mlp" in [a.name for a in catalog.sync(client=client).architectures]
    assert list_workers.sync(client=client)[0].device == "cpu"

    # The answers as they came, against the document's schemas (the generated models are lenient).
    with open_service.client() as c:
        for op_id, path in (("get_job", f"/jobs/{job.id}"), ("get_job", f"/jobs/{queued.id}"),
                            ("list_jobs", "/jobs?include=spec,errors,result"),
                            ("job_metrics", f"/jobs/{job.id}/metrics"),
                            ("job_result", f"/jobs/{predict.id}/result"), ("job_result", f"/jobs/{job.id}/result"),
                            ("job_result", f"/jobs/{evaluate.id}/result"),
                            ("get_sweep", f"/sweeps/{sweep.id}"), ("sweep_curves", f"/sweeps/{sweep.id}/curves"),
                            ("list_devices", "/devices"), ("catalog", "/catalog"), ("healthz", "/healthz"),
                            ("list_datasets", "/datasets")):
            r = c.get(path)
            assert r.status_code == 200, (path, r.text)
            conforms(document, op_id, 200, r.json())


def results_are_typed(client, trained: int, predicted: int, evaluated: int) -> None:
    """GET /jobs/{id}/result of each kind, parsed into its kind's model: its fields typed attributes."""
    from ty_api.api.jobs import job_result
    from ty_api.models import EvaluationResult, PredictionResult, TrainResult

    result = job_result.sync(predicted, client=client)
    assert isinstance(result, PredictionResult) and len(result.predictions) == 2, result
    assert not result.additional_properties  # every field the worker writes is declared
    row = result.predictions[1]
    assert row.index == 1 and row.class_ in result.class_names and len(row.probabilities) == len(result.class_names)
    train = job_result.sync(trained, client=client)
    assert isinstance(train, TrainResult) and train.epochs == 3 and train.input_shape == [4], train
    assert train.val_accuracy >= 0 and not train.additional_properties
    scores = job_result.sync(evaluated, client=client)
    assert isinstance(scores, EvaluationResult) and scores.samples == sum(map(sum, scores.confusion_matrix)), scores
    assert set(scores.per_class_accuracy.additional_properties) == set(scores.class_names)
    assert not scores.additional_properties


def _until(read, done, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read()
        if done(value):
            return value
        time.sleep(0.2)
    raise AssertionError(f"not done after {timeout}s: {value}")


@pytest.mark.slow
def test_a_generated_client_with_a_token(api, tmp_path):
    from ty_api import AuthenticatedClient, Client
    from ty_api.api.jobs import get_job, list_jobs, submit_job
    from ty_api.api.system import healthz
    from ty_api.models import ErrorPublic, JobState, TrainJob

    with serving(tmp_path / "data", workers=0, env={"TRAINYARD_API_TOKEN": TOKEN}) as svc, ExitStack() as stack:
        authed = stack.enter_context(AuthenticatedClient(base_url=svc.url, token=TOKEN))
        made = submit_job.sync_detailed(client=authed, body=TrainJob.from_dict(tiny_job()))
        assert made.status_code == 201 and made.parsed.state == JobState.QUEUED
        assert [j.id for j in list_jobs.sync(client=authed).data] == [made.parsed.id]
        missing = get_job.sync_detailed(424242, client=authed)
        assert missing.status_code == 404 and isinstance(missing.parsed, ErrorPublic)
        for client in (stack.enter_context(Client(base_url=svc.url)),
                       stack.enter_context(AuthenticatedClient(base_url=svc.url, token="wrong"))):
            refused = get_job.sync_detailed(made.parsed.id, client=client)
            assert refused.status_code == 401 and "bearer token" in refused.parsed.detail
            assert submit_job.sync_detailed(client=client, body=TrainJob.from_dict(tiny_job())).status_code == 401
        assert healthz.sync(client=client).status == "ok"  # /healthz needs no token
