"""Wire types of the REST API (apart from the tables): JobPublic, JobsPublic, MetricPublic, WorkerPublic,
SweepPublic, TrialPublic, ErrorPublic (schemas_service: the answers about the service)."""
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

from trainyard.app.core.states import Failure, JobState
from trainyard.app.records import Job
from trainyard.app.records.job_summaries import spec_summary

# Result keys that can be large. They live in a file beside the job's run (GET /jobs/{id}/result);
# rows written before that held them inline, and still show only a count.
_BULKY = ("predictions", "confusion_matrix", "per_class_accuracy")


def ts(v: float | None) -> datetime | None:
    return datetime.fromtimestamp(v, tz=UTC) if v is not None else None


class Progress(BaseModel):
    epoch: int | None = None
    epochs: int | None = None


class EpochMetrics(BaseModel):
    """An epoch's record: the trainer's metrics below, or what a run job reported (any names, numbers)."""
    __pydantic_extra__: dict[str, float | None]
    model_config = ConfigDict(extra="allow")
    epoch: int
    epochs: int | None = Field(None, description="epochs the run expects (train jobs)")
    train_loss: float | None = None
    val_loss: float | None = Field(None, description="null on epochs not evaluated (train.eval_every)")
    val_accuracy: float | None = None
    lr: float | None = Field(None, description="the learning rate of the epoch's last optimizer step")
    effective_batch: int | None = Field(None, description="samples per optimizer step (all devices, accumulated)")
    grad_norm: float | None = Field(None, description="mean gradient norm before clipping (train.grad_clip_norm)")
    samples_per_s: float | None = None
    seconds: float | None = None
    memory_allocated: int | None = None
    memory_reserved: int | None = None
    max_memory_allocated: int | None = None


class MetricPublic(EpochMetrics):
    attempt: int


class JobErrorPublic(BaseModel):
    """A failed run's error (its traceback is in the job's log)."""
    model_config = ConfigDict(extra="allow", populate_by_name=True, serialize_by_alias=True)
    class_: Failure = Field(alias="class", description="decides whether the job is tried again")
    type: str = Field(description="the exception's or the failure's name")
    message: str
    attempt: int | None = Field(None, description="in `errors`: the attempt it ended")


class JobResult(BaseModel):
    """A job's result. train: epochs, train_loss, val_loss, val_accuracy, samples_per_s, input_shape, num_classes,
    class_names, parameters, kept_epoch...; predict on inputs: predictions (rows; in a job's `result`, their count),
    class_names; predict on a dataset: samples, accuracy, loss, per_class_accuracy, confusion_matrix; run: what
    its entrypoint returned."""
    model_config = ConfigDict(extra="allow")


# SerializeAsAny: the job's parts as job_fields gives them (plain values, JobPublic.from_job's model_construct) are
# serialised as they are, not as the model each documents.


class JobSummary(BaseModel):
    """What a list page shows of each job; JobPublic (GET /jobs/{id}) adds the spec, errors and result."""
    id: int
    kind: str
    name: str | None
    state: JobState
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int = Field(description="attempts used (runs lost to a worker shutdown do not count)")
    max_attempts: int
    runs: int = Field(description="times the job has been claimed by a worker")
    worker_id: str | None
    requested_device: str = Field(description="the spec's device: auto, cpu, cuda or cuda:N")
    device: str | None = Field(description="the device the job ran on (rank 0's, for a job on several devices)")
    ranks: list[dict[str, str]] | None = Field(None, description="a job on several devices: each rank's worker, "
                                                                 "device and host (across hosts also its address, "
                                                                 "and rank 0's rendezvous port), rank 0 first, for "
                                                                 "its latest run")
    progress: Progress
    latest_metrics: SerializeAsAny[EpochMetrics] | None
    peak_memory_allocated: int | None = Field(description="peak torch.cuda.max_memory_allocated (bytes, CUDA only)")
    peak_memory_reserved: int | None = Field(description="peak torch.cuda.memory_reserved (bytes, CUDA only)")
    checkpoint_epoch: int | None
    parameters: int | None = Field(None, description="the model's parameter count (train jobs), counted at submit")
    error: SerializeAsAny[JobErrorPublic] | None = Field(description="the latest error, without its traceback")
    runs_on: str | None = Field(None, description="\"slurm\": it runs in a Slurm allocation of its own; null: on "
                                "trainyard's own workers")
    slurm: dict[str, Any] | None = Field(None, description="a job on Slurm: its latest allocation as last seen: "
                                         "{id, partition, nodes, state, reason}")
    waiting_for: str | None = Field(None, description="a queued job no live worker can take: why (no worker for "
                                                      "its device, plugin or GPU memory); null while it only waits "
                                                      "its turn")
    sweep: dict[str, Any] | None = Field(None, description="a sweep's trial: {id, trial, params} (the sweep, the "
                                                          "trial's number, the values it tries)")
    pinned: bool = Field(False, description="kept from deletion (POST /jobs/{id}/pin, /unpin)")
    reclaimed: dict[str, Any] | None = Field(None, description="retention removed its files, keeping its row: "
                                                              "{at, why} (a sweep's trial outside its keep_best)")
    summary: dict[str, Any] | None = Field(None, description="what a list shows of the spec: arch, dataset (train); "
                                                            "model_job and rows, or dataset and split (predict); "
                                                            "entrypoint (run)")
    owner: str | None = Field(None, description="the user who submitted it (null: from before accounts)")
    project_id: int | None = Field(None, description="the project it belongs to (null: the admins' only)")


# The parts of a job a list page leaves out unless asked (GET /jobs?include=spec,errors,result): they are
# most of a row's bytes, and decoding and encoding them most of a list request's cost.
HEAVY = ("spec", "errors", "result")


def job_fields(job: Job, waiting_for: str | None, include: tuple[str, ...] = HEAVY,
               summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """A job as JobPublic's (or, with less included, JobListItem's) plain values, ready for
    pydantic_core.to_json: the hot reads serialise these directly, the response models document them.
    (model_construct per item was most of a list page's cost.) summary: job_summaries.summaries' for a job read
    without its spec."""
    error: dict[str, Any] | None = dict(job.error) if job.error is not None else None
    if error:
        error = {k: v for k, v in error.items() if k != "traceback"}
    out = dict(
        id=job.id, kind=job.kind, name=job.name, state=job.state, priority=job.priority,
        created_at=ts(job.created_at), started_at=ts(job.started_at), finished_at=ts(job.finished_at),
        attempt=job.attempt, max_attempts=job.max_attempts, runs=job.claim, worker_id=job.worker_id,
        requested_device=job.device_req, device=job.device, ranks=job.ranks,
        progress={"epoch": job.epoch, "epochs": job.epochs},
        latest_metrics=job.latest_metrics, peak_memory_allocated=job.peak_memory_allocated,
        peak_memory_reserved=job.peak_memory_reserved, checkpoint_epoch=job.checkpoint_epoch,
        parameters=job.parameters, error=error, waiting_for=waiting_for, sweep=job.sweep, pinned=job.pinned,
        reclaimed=job.reclaimed, owner=job.owner, project_id=job.project_id, runs_on=job.runs_on, slurm=job.slurm,
        summary=summary if summary is not None or job.spec is None else spec_summary(job.kind, job.spec))
    if "spec" in include:
        out["spec"] = job.spec
    if "errors" in include:
        out["errors"] = [{k: v for k, v in e.items() if k != "traceback"} for e in job.errors]
    if "result" in include:
        result = stored = job.result
        if stored and isinstance(stored.get("predictions", stored.get("confusion_matrix")), list):
            # A row from before results moved beside the run: show the same summary a new one holds.
            result = {k: v for k, v in stored.items() if k not in _BULKY}
            if isinstance(stored.get("predictions"), list):
                result["predictions"] = len(stored["predictions"])
        out["result"] = result
    return out


class JobPublic(JobSummary):
    spec: dict[str, Any] = Field(description="the job as submitted (its defaults filled in)")
    errors: list[SerializeAsAny[JobErrorPublic]] = Field(description="every error of every attempt, oldest first")
    result: SerializeAsAny[JobResult] | None = Field(description="summary of the result; GET /jobs/{id}/result has "
                                                                 "all of it")
    tracking: dict[str, Any] | None = Field(None, description="GET /jobs/{id} only, where the service tracks: "
                                            "{mlflow: {run_id, experiment_id, url (the run's page), complete (the "
                                            "tracker holds all the job's records), status, error (the tracker's last "
                                            "error, sent again later), earlier_runs (before a retry), model_version}}")

    @classmethod
    def from_job(cls, job: Job, waiting_for: str | None = None) -> "JobPublic":
        # Built without validation: every value comes from our own database in the types above.
        values = job_fields(job, waiting_for)
        return cls.model_construct(**{**values, "progress": Progress.model_construct(**values["progress"])})


class JobListItem(JobSummary):
    spec: dict[str, Any] | None = Field(None, description="present with include=spec")
    errors: list[SerializeAsAny[JobErrorPublic]] | None = Field(None, description="present with include=errors")
    result: SerializeAsAny[JobResult] | None = Field(None, description="present with include=result (its summary)")


class FieldError(BaseModel):
    loc: list[str | int] = Field(description='where: ["body", "train", "lr"], ["query", "limit"]...')
    msg: str
    type: str


class ErrorPublic(BaseModel):
    """Every error the server sends, whatever its status (422 included)."""
    detail: str | list[FieldError] = Field(description="what is wrong; for a field: [{loc, msg, type}]")


def responses(**codes: str) -> dict:
    """OpenAPI error responses: responses(not_found="no such job") -> {404: {...}}."""
    status = {"unauthorized": 401, "not_found": 404, "conflict": 409, "gone": 410, "too_large": 413}
    return {status[name]: {"model": ErrorPublic, "description": text} for name, text in codes.items()}


NOT_FOUND = responses(not_found="no such job")
UNAUTHORIZED = responses(unauthorized="a token is configured and the request did not carry it")


class JobsPublic(BaseModel):
    data: list[JobListItem]
    count: int = Field(description="jobs matching the filter, over all pages")
    limit: int
    offset: int
    truncated: bool = Field(False, description="the page ended before `limit` items though more match: its "
                                               "bytes reached TRAINYARD_MAX_LIST_BYTES (include less, or go on at "
                                               "next_offset)")
    next_offset: int | None = Field(None, description="the offset of the next page; null on the last")


class WorkerPublic(BaseModel):
    id: str
    host: str
    addr: str | None = Field(None, description="the address other hosts reach this worker's host at "
                             "(TRAINYARD_NODE_ADDR); null when it gave none, and for a token not an admin's")
    pid: int | None = Field(description="its process id; null for a token not an admin's")
    device: str
    state: str = Field(description="idle, busy (running a job, or lending its device to one), unavailable (alive "
                       "but unable to use its device: see `unavailable`), stopping, stopped, or lost (no "
                       "heartbeat within the lease)")
    job_id: int | None
    started_at: datetime
    last_heartbeat: datetime
    last_heartbeat_age_s: float
    torch: dict[str, Any] | None = Field(None, description="the worker's last reported torch allocator stats")
    draining: bool = Field(False, description="finishing what it runs, claiming nothing more "
                                              "(POST /workers/{id}/drain, /undrain)")
    unavailable: str | None = Field(None, description="why the worker cannot use its device (no CUDA, a driver "
                                    "older than its torch build needs, a device missing or failed) and the fix; "
                                    "it then claims no job")
