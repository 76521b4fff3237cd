"""Wire types of the REST API (apart from the tables): JobPublic, JobsPublic, MetricPublic, WorkerPublic."""
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, Field

# Result keys that can be large; the job shows a count and GET /jobs/{id}/result the whole thing.
_BULKY = ("predictions", "confusion_matrix", "per_class_accuracy")


def ts(v: float | None) -> datetime | None:
    return datetime.fromtimestamp(v, tz=timezone.utc) if v is not None else None


class Progress(BaseModel):
    epoch: int | None = None
    epochs: int | None = None


class JobPublic(BaseModel):
    id: int
    kind: str
    name: str | None
    state: str
    spec: dict[str, Any]
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int = Field(description="attempts used (runs lost to a worker shutdown do not count)")
    max_attempts: int
    runs: int = Field(description="times the job has been claimed by a worker")
    worker_id: str | None
    device: str | None = Field(description="the device the job ran on")
    progress: Progress
    latest_metrics: dict[str, Any] | None
    peak_memory_allocated: int | None = Field(description="peak torch.cuda.max_memory_allocated (bytes, CUDA only)")
    peak_memory_reserved: int | None = Field(description="peak torch.cuda.memory_reserved (bytes, CUDA only)")
    checkpoint_epoch: int | None
    error: dict[str, Any] | None
    errors: list[dict[str, Any]]
    result: dict[str, Any] | None = Field(description="summary of the result; GET /jobs/{id}/result has all of it")

    @classmethod
    def from_row(cls, row: dict) -> "JobPublic":
        result = row["result"]
        if result:
            result = {k: v for k, v in result.items() if k not in _BULKY}
            if row["result"].get("predictions") is not None:
                result["predictions"] = len(row["result"]["predictions"])
        error = row["error"]
        if error:
            error = {k: v for k, v in error.items() if k != "traceback"}
        # Built without validation: every value comes from our own database in the types above, and
        # validating dozens of nested dicts per page was most of a list request's cost.
        return cls.model_construct(
            id=row["id"], kind=row["kind"], name=row["name"], state=row["state"], spec=row["spec"],
            priority=row["priority"], created_at=ts(row["created_at"]), started_at=ts(row["started_at"]),
            finished_at=ts(row["finished_at"]), attempt=row["attempt"], max_attempts=row["max_attempts"],
            runs=row["claim"], worker_id=row["worker_id"], device=row["device"],
            progress=Progress.model_construct(epoch=row["epoch"], epochs=row["epochs"]),
            latest_metrics=row["latest_metrics"],
            peak_memory_allocated=row["peak_memory_allocated"], peak_memory_reserved=row["peak_memory_reserved"],
            checkpoint_epoch=row["checkpoint_epoch"], error=error,
            errors=[{k: v for k, v in e.items() if k != "traceback"} for e in (row["errors"] or [])],
            result=result)


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int = Field(description="jobs matching the filter, over all pages")
    limit: int
    offset: int


class MetricPublic(BaseModel):
    model_config = {"extra": "allow"}
    epoch: int
    attempt: int
    train_loss: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    samples_per_s: float | None = None
    seconds: float | None = None
    memory_allocated: int | None = None
    memory_reserved: int | None = None
    max_memory_allocated: int | None = None


class WorkerPublic(BaseModel):
    id: str
    host: str
    pid: int
    device: str
    state: str = Field(description="idle, busy, stopped, or lost (no heartbeat within the lease)")
    job_id: int | None
    started_at: datetime
    last_heartbeat: datetime
    last_heartbeat_age_s: float
    torch: dict[str, Any] | None = Field(None, description="the worker's last reported torch allocator stats")


class Message(BaseModel):
    detail: str
