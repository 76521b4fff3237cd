"""The job and sweep records: one row of the jobs (sweeps) table as a frozen, typed object that crosses every
seam (queue -> API, queue -> supervisor -> job process; sweep store and reads -> driver, API). Plain types
only, so pickling one into a job process does not drag SQLAlchemy along."""
from dataclasses import asdict, dataclass, fields
from typing import Any, NotRequired, TypedDict

from trainyard.app.core.states import ErrorRecord, JobState, SweepState


class Rank(TypedDict):
    """One device of a multi-device run (Job.ranks, rank 0 first), as app/fleet/placement.py chooses it at the
    claim: stored as JSON in the job's row, so its keys are these strings. Here, beside the record that carries
    it, as every room above reads it (fleet, jobs, the worker)."""
    worker: str   # the worker whose device it is (lent to the run but for rank 0's)
    device: str   # "cpu", "cuda:0"
    key: str      # its slot key (a GPU's UUID; the worker's id on the CPU)
    host: str
    addr: NotRequired[str]  # a job across hosts: the host's address for the ranks (TRAINYARD_NODE_ADDR)
    port: NotRequired[str]  # rank 0's only: the port its ranks meet at (app/fleet/spread.master)


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
    hosts: int | None            # hosts they are spread over (None: 1)
    ranks: list[Rank] | None    # a multi-device run's devices, rank 0 first
    checkpoint_path: str | None  # relative to the data dir
    checkpoint_epoch: int | None
    artifact_path: str | None    # relative to the data dir: the run dir of the run that succeeded
    result: dict[str, Any] | None
    error: ErrorRecord | None
    errors: list[ErrorRecord]    # every attempt's, oldest first, each with its "attempt"
    sweep_id: int | None = None  # a sweep's trial: the sweep, and {"id", "trial", "params"}
    sweep: dict[str, Any] | None = None
    pinned: bool = False         # kept from deletion (app/lifecycle/references.py)
    reclaimed: dict[str, Any] | None = None  # {"at", "why"}: retention removed its files (app/lifecycle/retention.py)
    project_id: int | None = None  # its project and who submitted it (app/accounts/__init__.py); None: the admin's
    owner: str | None = None
    preempt_requested_at: float | None = None  # the scheduler wants its device (app/fleet/preemption.py)
    runs_on: str | None = None  # "slurm": only an allocation of its own runs it (app/clusters/); None: own workers
    slurm: dict[str, Any] | None = None  # its latest allocation: {"id", "partition", "nodes", "state", "reason"}

    @classmethod
    def from_row(cls, row) -> "Job":
        return cls.from_values(row._asdict())  # a plain dict: list pages build fifty records per request

    @classmethod
    def from_values(cls, m: dict[str, Any]) -> "Job":
        """From a row's values by column name (its JSON columns parsed)."""
        values: dict[str, Any] = {name: m.get(name) for name in _FIELD_NAMES}  # a column left unread is None
        values["state"] = JobState(values["state"])
        values["errors"] = values["errors"] or []
        values["pinned"] = bool(values["pinned"])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELD_NAMES = tuple(f.name for f in fields(Job))


class SweepPlan(TypedDict):
    """What a sweep's stored spec says of its plan (app/sweep_results.summary): lists and events show it
    without the spec."""
    method: str
    metric: str
    direction: str
    max_trials: int       # SweepSpec.trials: the trials it makes in all
    max_concurrent: int


@dataclass(frozen=True, slots=True)
class Sweep:
    id: int
    name: str | None
    state: SweepState
    created_at: float
    finished_at: float | None
    error: str | None            # why it failed or ended; while it runs, why a trial waits
    trial_count: int             # trials made so far
    summary: SweepPlan
    spec: dict[str, Any] | None = None  # as submitted (validated then, never again); None: read without it
    driver: str | None = None    # the server process that advances it, until driver_until (database clock)
    driver_until: float | None = None
    project_id: int | None = None  # as a job's
    owner: str | None = None

    @classmethod
    def from_values(cls, m: dict[str, Any], summary: SweepPlan) -> "Sweep":
        """From a row's values by column name (the spec left out of a row read without it)."""
        values: dict[str, Any] = {name: m.get(name) for name in _SWEEP_FIELDS if name != "summary"}
        values["state"] = SweepState(values["state"])
        return cls(**values, summary=summary)

    def as_dict(self) -> dict[str, Any]:
        """Its fields by name, the spec not copied (it may be most of a request body)."""
        return {name: getattr(self, name) for name in _SWEEP_FIELDS}


_SWEEP_FIELDS = tuple(f.name for f in fields(Sweep))
