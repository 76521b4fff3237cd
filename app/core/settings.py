"""Configuration: one Settings object read from TRAINYARD_* environment variables."""
import ipaddress
import socket
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainyard.app.core import operator_token, storage
from trainyard.app.core.layout import Layout


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")

    data_dir: Path = Path("./trainyard-data")
    # Empty means "the SQLite file under data_dir"; a PostgreSQL URL lets several hosts share one queue.
    database_url: str = ""
    # Empty means "the data directory"; s3://bucket/prefix keeps artifacts, checkpoints, uploads and job logs
    # in a bucket (AWS S3, MinIO, R2, Ceph: credentials and AWS_ENDPOINT_URL_S3 from the usual AWS_* variables),
    # so that hosts share them.
    storage_url: str = ""
    url: str = "http://127.0.0.1:8000"
    api_token: str | None = None

    host: str = "127.0.0.1"
    port: int = 8000

    # A claimed job's lease; the worker renews it every heartbeat_s. Expired leases are requeued.
    lease_s: float = Field(15.0, gt=0)
    heartbeat_s: float = Field(2.0, gt=0)
    # An idle worker is woken when the queue changes (app/db/wakeup.py); it also looks this often, as a
    # safety net for a lost wake-up.
    poll_s: float = Field(2.0, gt=0)
    # How long a SIGTERMed worker waits for its job to checkpoint before killing it.
    grace_s: float = Field(30.0, ge=0)
    max_body_bytes: int = Field(1 << 20, gt=0)

    # HTTP: which Host headers the server answers (DNS rebinding), and which other web origins may
    # send it state-changing requests (none by default: a page on another site must not act for its user).
    # Comma-separated; "*" in allowed_hosts answers any host.
    allowed_hosts: str = "localhost,127.0.0.1,[::1]"
    allowed_origins: str = ""

    # Uploads (POST /datasets).
    max_upload_bytes: int = Field(200 << 20, gt=0)
    max_upload_files: int = Field(100_000, gt=0, description="members of one zip or .npz upload")
    upload_quota_bytes: int = Field(10 << 30, gt=0, description="stored bytes of all uploads together")
    max_uploads: int = Field(1000, gt=0, description="uploaded datasets kept at once")
    # What one project may hold of the two above (unset: half of each, at least 1; see per_project).
    upload_quota_bytes_per_project: int | None = Field(None, gt=0)
    max_uploads_per_project: int | None = Field(None, gt=0)
    # Decoded built-in datasets and FakeData: least recently used entries are evicted past this.
    dataset_cache_bytes: int = Field(20 << 30, gt=0)

    # What one job may cost. A job process over its host-memory budget fails as `oom` (not retried);
    # the default budget is job_memory_share of the host's memory divided among its live workers.
    job_memory_bytes: int | None = Field(None, gt=0)
    job_memory_share: float = Field(0.8, gt=0, le=1)
    # Cap on the share of its GPU's memory one job process may take (torch's per-process fraction).
    job_gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    # A job's log on disk (what it prints, all runs together): past it, its first quarter and latest
    # output are kept, with a line saying how much was dropped between (worker/supervisor/joblog.py).
    job_log_bytes: int = Field(16 << 20, ge=64 << 10)
    # The memory a worker's device offers to jobs that state resources.gpu_memory_gb (GB, 10^9 bytes):
    # default, a GPU's total (NVML); set lower to keep headroom. CPU workers offer none unless this
    # is set (then the host's CPU workers share it, as workers on one GPU share that GPU's).
    device_memory_gb: float | None = Field(None, gt=0, le=1_000_000)
    # Bytes each job that states its GPU memory is counted for beyond its statement on a GPU (its CUDA
    # context, outside the allocator's cap): jobs packed to the card's total must still fit (app/fleet/placement.py).
    gpu_context_headroom_bytes: int = Field(1 << 30, ge=0, le=1 << 40)
    # After a job process on a GPU ends, its worker claims nothing until NVML no longer lists the job's
    # processes there (their CUDA contexts freed), for at most this long (worker/supervisor/gpu_release.py); 0: no wait.
    gpu_release_wait_s: float = Field(30.0, ge=0, le=3600)
    # Which installed plugins this process offers: "*" all, "" none, or a comma-separated list of names.
    plugins: str = "*"
    # Built-in architectures over this many parameters are refused at submit (422).
    max_parameters: int = Field(1_000_000_000, gt=0)
    # A predict job's output: rows x probabilities per row (classes, or top_k) at most this many.
    max_predict_values: int = Field(1_000_000, gt=0)
    # A page of a list (GET /jobs, GET /jobs/{id}/metrics): its items' stored JSON at most about this many bytes
    # (the first item always); past it the page ends early and says where the next one starts.
    max_list_bytes: int = Field(4 << 20, gt=0)
    # Server-Sent Event streams (GET /jobs/{id}/events, /sweeps/{id}/events) open at once in one server
    # process, and on one job or sweep; past either, 503 with Retry-After.
    max_event_streams: int = Field(1000, gt=0)
    max_event_streams_per_target: int = Field(300, gt=0)
    # Sweeps running at once (each is read and advanced several times a second); past it POST /sweeps is a 409.
    max_running_sweeps: int = Field(50, gt=0)
    # What one project may hold of the two caps above (unset: half of each, at least 1; see per_project).
    max_event_streams_per_project: int | None = Field(None, gt=0)
    max_running_sweeps_per_project: int | None = Field(None, gt=0)
    # Model exports (GET /jobs/{id}/artifact?format=onnx...) waiting for a slot in one server process (two
    # run at once, each a process that imports torch); past it a new one is a 503 with Retry-After.
    export_queue: int = Field(8, ge=0, le=10_000)

    # Retention (app/lifecycle/retention.py, run by the collector: app/lifecycle/collector.py). Durations in seconds;
    # 0 keeps
    # for ever where said. Succeeded jobs' models and results are kept until deleted.
    # Checkpoints of failed, cancelled and pruned jobs, kept so that a retry resumes (succeeded: removed at once).
    checkpoint_ttl_s: float = Field(7 * 86400.0, ge=0)
    # Failed and cancelled jobs (rows and files) that are not sweep trials, not pinned and named by no job
    # still to run; 0 keeps them.
    ended_job_ttl_s: float = Field(30 * 86400.0, ge=0)
    # A sweep's trials outside its best k (the sweep's keep_best, else this) lose their files once it ends;
    # 0 keeps every trial's.
    sweep_keep_best: int = Field(5, ge=0, le=100_000)
    # Logs of ended jobs; 0 keeps them.
    log_ttl_s: float = Field(30 * 86400.0, ge=0)
    # Exported models (ONNX, ...), made again on the next request; 0 keeps them.
    export_ttl_s: float = Field(7 * 86400.0, ge=0)
    # Each host's copies of bucket objects (a bucket store only): the least recently used go past this.
    cache_bytes: int = Field(20 << 30, gt=0)
    # How often the collector runs, and how young an unreferenced object must be to be spared (a write in flight).
    collect_s: float = Field(600.0, gt=0)
    collect_grace_s: float = Field(600.0, ge=0)
    # Priority preemption (app/fleet/preemption.py): a running job gives its device up only after running this long
    # since it was claimed, so that a job is never preempted twice in a row within it.
    preempt_min_run_s: float = Field(600.0, ge=0)

    # Fair share between projects (app/fleet/fair_share.py): a run's device time counts half after this long.
    fair_share_half_life_s: float = Field(4 * 3600.0, gt=0)

    # Slurm (docs/scaling-out.md, "Slurm"): `trainyard slurm-agent` asks Slurm for one allocation per job that runs
    # there and starts the job's workers inside it. A partition set means Slurm is configured: a job may ask for
    # it (`runs_on: "slurm"`), and with slurm_default every job goes there unless its spec says "workers". Names
    # are checked as Slurm names (app/spec/slurm.py); sbatch_options are the operator's own, given to sbatch as
    # separate arguments (each "--option[=value]"), never through a shell; per project (by name, JSON): partition,
    # account, qos, time_limit_min over the service's.
    slurm_partition: str | None = Field(None, max_length=64)
    slurm_account: str | None = Field(None, max_length=64)
    slurm_qos: str | None = Field(None, max_length=64)
    slurm_time_limit_min: int | None = Field(None, ge=1, le=525_600)
    slurm_sbatch_options: str = Field("", max_length=2000)
    slurm_projects: dict[str, dict[str, str | int]] = Field(default_factory=dict)
    slurm_default: bool = False
    # Partitions a job may name beside the service's (comma-separated); a job's own account and qos need this on.
    slurm_job_partitions: str = Field("", max_length=2000)
    slurm_job_accounts: bool = False
    # What each rank asks of its node (one task per device; --cpus-per-task, --mem-per-cpu's product as --mem).
    slurm_cpus_per_rank: int = Field(1, ge=1, le=1024)
    slurm_mem_mb_per_rank: int | None = Field(None, ge=1, le=1 << 24)
    # The agent's look at the queue and at squeue; allocations that end before their job starts, before the job
    # fails; the database URL the nodes reach (default: database_url, as the agent's host reaches it).
    slurm_poll_s: float = Field(2.0, gt=0, le=600)
    slurm_max_asks: int = Field(3, ge=1, le=100)
    slurm_database_url: str = ""

    # The name this machine goes by in /devices, /workers and /metrics (default: its hostname). In a
    # container the hostname is the container's: set it to the machine's name, the same for the API
    # and the workers of one machine, so that their GPUs are seen as one host's.
    node_name: str | None = Field(None, max_length=200)
    # The address other hosts reach this host's ranks at (a job's rendezvous and collectives across hosts):
    # an IP or a name that resolves on every host, never a loopback one. None: no job's rank on another host
    # can reach this one. The interface NCCL and gloo use is theirs to pick: NCCL_SOCKET_IFNAME,
    # GLOO_SOCKET_IFNAME in the worker's environment reach its job processes.
    node_addr: str | None = Field(None, max_length=255)
    # Where each worker writes its state at every heartbeat for the container's health check
    # (worker/supervisor/status_file.py, docker/healthcheck.py); the image's entrypoint sets it. None: not written.
    worker_status_dir: Path | None = None

    # MLflow (docs/observing.md, "MLflow"): with a tracking URI, every train, run and evaluation job is an MLflow
    # run, sent by the server from the job's records (app/tracking/), never by the job: a slow or absent tracker
    # never slows or fails a job. The experiment a job's run goes to, unless its spec names one ({project}: the
    # job's project, "default" for the admin's jobs). The credentials are the tracker's (MLflow's basic auth or a
    # bearer token): kept here, never in a job's spec, record or log.
    mlflow_tracking_uri: str = Field("", max_length=2000)
    mlflow_experiment: str = Field("trainyard-{project}", min_length=1, max_length=200)
    mlflow_username: str | None = None
    mlflow_password: SecretStr | None = None
    mlflow_token: SecretStr | None = None
    # One call to the tracker gives up after this long, and the server sends again later (backing off to
    # mlflow_retry_max_s while the tracker keeps failing).
    mlflow_timeout_s: float = Field(10.0, gt=0, le=600)
    mlflow_retry_max_s: float = Field(60.0, gt=0, le=3600)

    @field_validator("storage_url")
    @classmethod
    def _storage_url(cls, v: str) -> str:
        if v:
            storage.parse_url(v)
        return v

    @field_validator("node_addr")
    @classmethod
    def _node_addr(cls, v: str | None) -> str | None:
        v = (v or "").strip()
        if not v:  # TRAINYARD_NODE_ADDR= : none given
            return None
        try:
            ip = ipaddress.ip_address(v.strip("[]"))
        except ValueError:
            ip = None
        local = v.lower() == "localhost" or v.lower().endswith(".localhost")
        if local or (ip and (ip.is_loopback or ip.is_unspecified)):
            raise ValueError(f"{v!r} is not an address another host can reach: give this host's own address on the "
                             "network the hosts share (an IP, or a name every host resolves)")
        if any(c.isspace() for c in v) or "/" in v:
            raise ValueError(f"{v!r} is not a host address")
        return v

    @model_validator(mode="after")
    def _stored_token(self) -> "Settings":
        # A data directory whose server once listened beyond loopback keeps its admin token
        # (app/core/operator_token.py): every later server on it, wherever it listens, wants that token.
        if not self.api_token:
            self.api_token = operator_token.read(self.data_dir)
        return self

    def per_project(self, cap: str) -> int:
        """One project's part of a service-wide cap (max_uploads, upload_quota_bytes, max_event_streams,
        max_running_sweeps): its `<cap>_per_project` setting, else half the cap, at least 1. A member's request is
        checked against it first, then against the cap itself (docs/teams.md, "Shared caps")."""
        own = getattr(self, f"{cap}_per_project")
        return own if own is not None else max(1, getattr(self, cap) // 2)

    @property
    def node(self) -> str:
        return self.node_name or socket.gethostname()

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir.resolve() / 'trainyard.db'}"

    @property
    def allowed_host_list(self) -> list[str]:
        return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]

    @property
    def allowed_origin_list(self) -> list[str]:
        return [o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip()]

    @property
    def layout(self) -> Layout:
        return Layout(self.data_dir)

    @property
    def store(self) -> storage.Store:
        return storage.open_store(self.storage_url, self.layout)

    def ensure_dirs(self) -> None:
        self.layout.ensure()


@lru_cache
def get_settings() -> Settings:
    return Settings()
