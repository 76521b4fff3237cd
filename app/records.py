"""The job record: one row of the jobs table as a frozen, typed object that crosses every seam
(queue -> API, queue -> supervisor -> job process). Plain types only, so pickling one into a job
process does not drag SQLAlchemy along."""
from dataclasses import asdict, dataclass, fields
from typing import Any

from trainyard.app.states import JobState


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    kind: str
    name: str | None
    state: JobState
    spec: dict[str, Any]
    device_req: str
    priority: int
    max_attempts: int
    timeout_s: float | None
    idempotency_key: str | None
    attempt: int                # runs that used up an attempt
    claim: int                  # the fencing token: grows on every claim
    worker_id: str | None
    device: str | None
    lease_expires_at: float | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    epoch: int | None
    epochs: int | None
    latest_metrics: dict[str, Any] | None
    peak_memory_allocated: int | None
    peak_memory_reserved: int | None
    parameters: int | None
    need_model: str | None
    need_dataset: str | None
    need_entrypoint: str | None
    need_gpu_memory: int | None  # bytes (resources.gpu_memory_gb); None: the whole device
    gpu_key: str | None          # the device it was claimed on (a GPU's UUID), for sharing it
    devices: int | None          # devices the job spans (None: 1)
    ranks: list[dict[str, str]] | None  # a multi-device run's [{"worker", "device"}], rank 0 first
    checkpoint_path: str | None  # relative to the data dir
    checkpoint_epoch: int | None
    artifact_path: str | None    # relative to the data dir: the run dir of the run that succeeded
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    errors: list[dict[str, Any]]
    sweep_id: int | None = None  # a sweep's trial: the sweep, and {"id", "trial", "params"}
    sweep: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row) -> "Job":
        return cls.from_values(row._asdict())  # a plain dict: list pages build fifty records per request

    @classmethod
    def from_values(cls, m: dict[str, Any]) -> "Job":
        """From a row's values by column name (its JSON columns parsed)."""
        values = {name: m.get(name) for name in _FIELD_NAMES}  # a column left unread is None
        values["state"] = JobState(values["state"])
        values["errors"] = values["errors"] or []
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELD_NAMES = tuple(f.name for f in fields(Job))
