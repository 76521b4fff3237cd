"""Wire types of the answers about the service and its reads that are built as plain values (GET /devices,
/catalog, /healthz, /sweeps/{id}/curves, /storage): the routes serialise the values themselves, these models document
them, so that a generated client gets typed objects (tests/api/test_openapi.py checks the real answers against
them). Open objects (extra="allow") where an answer carries more than is listed: a plugin's own fields, an
NVML reading's, a dataset's description."""
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainyard.app.core.states import JobState

OPEN = ConfigDict(extra="allow")


class Health(BaseModel):
    status: Literal["ok"]


class DeviceWorker(BaseModel):
    """A worker as /devices shows it, under its device."""
    id: str
    host: str
    pid: int | None = Field(description="its process id; null for a token not an admin's")
    device: str
    state: str = Field(description="idle, busy, unavailable, stopping, stopped or lost (as GET /workers)")
    job_id: int | None = None
    torch: dict[str, Any] | None = Field(None, description="its last reported torch allocator stats")
    last_heartbeat_age_s: float
    draining: bool = False
    unavailable: str | None = None


class Gpu(BaseModel):
    """A GPU, keyed by its UUID across hosts; NVML's reading (null where it could not be read)."""
    model_config = OPEN
    name: str | None = None
    uuid: str | None = None
    compute_capability: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    utilization_gpu: int | None = None
    mig_parent: str | None = Field(None, description="a MIG instance: its card's UUID")
    problem: str | None = Field(None, description="why CUDA cannot use it, when it cannot")
    index: int | None = Field(None, description="its cuda:N on its host; null when hidden from CUDA")
    host: str
    workers: list[DeviceWorker] = []


class Cpu(BaseModel):
    model_config = OPEN
    cores: int | None = Field(None, description="the cores a worker here may use: its CPU affinity, or its "
                              "container's CPU quota (--cpus, limits.cpu) in whole cores where fewer")
    memory_total: int | None = Field(None, description="bytes: the host's, or its container's limit where lower")
    memory_available: int | None = Field(None, description="bytes a new process could still take: the host's "
                                         "MemAvailable, or what the container's limit leaves where less")
    workers: list[DeviceWorker] = []


class DeviceHost(BaseModel):
    host: str
    driver_version: str | None = None
    cpu: Cpu
    cuda_devices: list[Gpu]
    other_workers: list[DeviceWorker]


class DevicesPublic(BaseModel):
    cuda_available: bool
    driver_version: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    cudnn_version: str | None = None
    hosts: list[DeviceHost] = Field(description="every host, this server's first")
    cuda_devices: list[Gpu] = Field(description="every GPU of every host")
    cpu: Cpu = Field(description="this server's CPU, with every CPU worker")
    other_workers: list[DeviceWorker] = Field(description="GPU workers on no listed GPU (unavailable ones, say)")


class CatalogArch(BaseModel):
    name: str
    params: list[str]
    inputs: str
    source: str | None = None


class CatalogDataset(BaseModel):
    model_config = OPEN
    name: str


class CatalogPlugin(BaseModel):
    model_config = OPEN
    kind: str
    name: str
    installed_on: list[str] = Field(description='"this server", or workers\' ids')


class CatalogPublic(BaseModel):
    architectures: list[CatalogArch]
    datasets: list[CatalogDataset]
    activations: list[str]
    devices: list[str]
    plugins: list[CatalogPlugin]
    schemas: dict[str, dict[str, Any]] = Field(description="each job kind's JSON schema")


class CurveTrial(BaseModel):
    trial: int
    job_id: int
    state: JobState
    failure: str | None
    best: bool
    points: list[list[float]] = Field(description="[epoch, value] pairs, in the order recorded")


class CurvesPublic(BaseModel):
    metric: str
    direction: Literal["minimize", "maximize"]
    next: int = Field(description="the `since` of the next page (and of the points recorded later)")
    more: bool = Field(description="points were left for the next page")
    trials: list[CurveTrial]


class KindUsage(BaseModel):
    bytes: int = Field(description="their size, in bytes")
    objects: int = Field(description="how many objects (files) the store holds of this kind")


class StorageRules(BaseModel):
    """The retention settings (TRAINYARD_<NAME>, docs/configuration.md); durations in seconds, 0 keeps for ever."""
    checkpoint_ttl_s: float = Field(description="failed, cancelled and pruned jobs' checkpoints, after they ended")
    ended_job_ttl_s: float = Field(description="failed and cancelled jobs (not sweep trials), rows and files")
    sweep_keep_best: int = Field(description="an ended sweep's trials that keep their files (its keep_best first)")
    log_ttl_s: float = Field(description="ended jobs' logs")
    export_ttl_s: float = Field(description="exported models (made again on request)")
    cache_bytes: int = Field(description="each host's copies of bucket objects (a bucket store only)")
    collect_s: float = Field(description="how often the collector runs")
    collect_grace_s: float = Field(description="how young an object no row names must be to be spared")


KINDS_TEXT = "by kind: artifacts, checkpoints, exports, logs, uploads (datasets), cache (this host's copies)"


class ProjectUsage(BaseModel):
    name: str
    bytes: int = Field(description="what its jobs (artifacts, exports, checkpoints, logs) and datasets store, in "
                                   "bytes")
    objects: int = Field(description="how many objects (files) they are")


class StoragePublic(BaseModel):
    """An admin sees the whole store; a member, their own project's part of it only (docs/teams.md)."""
    store: str | None = Field(description="where the objects are: the data directory, or s3://bucket/prefix; null "
                                          "for a member")
    kinds: dict[str, KindUsage] = Field(description=f"what the collector's last pass measured, {KINDS_TEXT}; empty "
                                                    "for a member (the kinds span every project)")
    project: ProjectUsage | None = Field(None, description="a member's own project, as the collector's last pass "
                                                           "measured it; null for an admin")
    measured_at: datetime | None = Field(description="when: null before the first pass")
    rules: StorageRules


class CollectionPublic(BaseModel):
    """What one pass of the collector did (the retention rules, then the objects no row names), and the store
    as it left it."""
    took_s: float
    deleted_objects: int = Field(description="objects no row names any more, removed")
    deleted_bytes: int
    checkpoints_dropped: int = Field(description="jobs whose checkpoint the rules let go")
    jobs_deleted: int = Field(description="ended jobs past ended_job_ttl_s, deleted")
    trials_reclaimed: int = Field(description="sweep trials outside their sweep's best, whose files went")
    evicted_objects: int = Field(description="this host's copies of bucket objects evicted past cache_bytes")
    usage: dict[str, KindUsage] = Field(description=f"the store after the pass, {KINDS_TEXT}")
    measured_at: datetime | None
