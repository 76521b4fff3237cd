"""The tables: every row the service keeps, one Table each, on one MetaData that the migrations (app/db/migrations/)
build and tests/db/test_schema.py compares. app/db/__init__.py re-exports them, with the engine and the transactions."""
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

jobs = Table(
    "jobs", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("kind", String(16), nullable=False),
    Column("name", String(200)),
    Column("state", String(16), nullable=False, index=True),
    Column("spec", JSON, nullable=False),
    Column("device_req", String(16), nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False, default=3),
    Column("timeout_s", Float),
    Column("idempotency_key", String(200), unique=True),
    # attempt counts runs that used up an attempt; claim is the fencing token: it grows on every
    # claim, and every write a worker makes about the job is guarded by the claim it holds.
    Column("attempt", Integer, nullable=False, default=0),
    Column("claim", Integer, nullable=False, default=0),
    Column("worker_id", String(200)),
    Column("device", String(16)),
    Column("lease_expires_at", Float),
    Column("created_at", Float, nullable=False),
    # When it last entered the queue (submitted, retried, requeued): how long it has waited. NULL: created_at.
    Column("queued_at", Float),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("epoch", Integer),
    Column("epochs", Integer),
    Column("latest_metrics", JSON),
    Column("peak_memory_allocated", BigInteger),
    Column("peak_memory_reserved", BigInteger),
    Column("parameters", BigInteger),  # the model's size, counted at submit (train jobs)
    # The plugins a job needs of the worker that claims it (app/jobs/admission.py); NULL: none of that kind.
    Column("need_model", String(100)),
    Column("need_dataset", String(100)),
    Column("need_entrypoint", String(100)),
    # GPU memory the job asked for (resources.gpu_memory_gb, bytes): it shares a device with others
    # that stated theirs; NULL: it has its device to itself. gpu_key: the device it was claimed on.
    Column("need_gpu_memory", BigInteger),
    Column("gpu_key", String(200)),
    # Devices the job spans (1: one; more: DistributedDataParallel over that many workers' devices, ranks
    # [{"worker", "device", "key", "host"}] in rank order, rank 0 the claiming worker's), spread evenly over
    # `hosts` hosts (a job across hosts: each rank's "addr" too, and rank 0's rendezvous "port"). NULL reads as 1.
    Column("devices", Integer),
    Column("hosts", Integer),
    Column("ranks", JSON),
    Column("checkpoint_path", Text),
    Column("checkpoint_epoch", Integer),
    Column("artifact_path", Text),
    Column("result", JSON),
    Column("error", JSON),
    Column("errors", JSON),
    # A sweep's trial: the sweep's id, and {"id", "trial", "params"} (its number and the values it tries).
    Column("sweep_id", Integer, index=True),
    Column("sweep", JSON),
    # Kept from deletion (POST /jobs/{id}/pin): a model in use elsewhere. NULL reads as false
    # (app/lifecycle/references.py).
    Column("pinned", Boolean),
    # Set when retention removed the job's files but kept its row (a sweep trial outside the best k):
    # {"at": epoch seconds, "why": "..."}; its artifact_path and checkpoint are NULL from then on.
    Column("reclaimed", JSON),
    # Who submitted it, in which project (app/accounts/__init__.py); NULL: the admin token, or a release before
    # accounts.
    Column("project_id", Integer, index=True),
    Column("owner", String(100)),
    # When the scheduler asked the job's worker to stop it for a job that outranks it (app/fleet/preemption.py).
    Column("preempt_requested_at", Float),
    # Where it runs: NULL, the own workers; "slurm", its allocation's (app/clusters/). slurm: that allocation as the
    # agent last saw it ({"id", "partition", "nodes", "state", "reason"}).
    Column("runs_on", String(16)),
    Column("slurm", JSON),
    Index("ix_jobs_claim_order", "state", "priority", "id"),
    # Idle workers ask often whether anything fits their device: answer without scanning the queue.
    Index("ix_jobs_queued_device", "state", "device_req"),
    # Fair share reads the competing projects' jobs that ended within its window (app/fleet/fair_share.py's usage).
    Index("ix_jobs_project_finished", "project_id", "finished_at"),
    sqlite_autoincrement=True,  # a deleted job's id is never given to another (migration 0006)
)

# A job waits for these jobs to succeed before it may be claimed (`after`, and the job its model_job or
# init_from names): app/fleet/dependencies.py. after_id has no foreign key: a deleted dependency's row must stay
# visible here, so that its dependents fail for it.
job_deps = Table(
    "job_deps", metadata,
    Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("after_id", Integer, primary_key=True, index=True),
)
# A job whose model_job or init_from is "sweep:<id>:best" waits for that sweep to end; its best trial's id then
# takes the reference's place (in the spec and as a job_deps row) and this row goes (app/fleet/dependencies.py).
job_sweeps = Table(
    "job_sweeps", metadata,
    Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("sweep_id", Integer, nullable=False, index=True),
    Column("field", String(16), nullable=False),
)

metrics = Table(
    "metrics", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("data", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("job_id", "epoch", name="uq_metrics_job_epoch"),
)

workers = Table(
    "workers", metadata,
    Column("id", String(200), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("device", String(16), nullable=False),
    Column("state", String(16), nullable=False),
    Column("job_id", Integer),
    Column("stats", JSON),
    Column("started_at", Float, nullable=False),
    Column("last_heartbeat", Float, nullable=False),
    # Set by POST /workers/{id}/drain: the worker finishes what it runs and claims nothing more.
    Column("draining", Boolean),
    # Lent to a multi-device job's run: the worker claims nothing while job lent_to runs under claim
    # lent_claim (its device is one of that job's ranks). Stale values mean nothing, so no release is needed.
    Column("lent_to", Integer),
    Column("lent_claim", Integer),
)


# A search over a job's fields (app/sweeps/sweep_store.py, app/sweeps/search.py). Its trials are jobs (jobs.sweep_id).
sweeps = Table(
    "sweeps", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(200)),
    Column("state", String(16), nullable=False, index=True),
    Column("spec", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("error", Text),
    Column("trial_count", Integer, nullable=False, default=0),  # trials made so far
    # The server process that advances the sweep holds it until driver_until (database clock), as a
    # worker holds a job's lease: one driver at a time even when several hosts' servers run.
    Column("driver", String(200)),
    Column("driver_until", Float),
    Column("project_id", Integer, index=True),
    Column("owner", String(100)),
    sqlite_autoincrement=True,
)

# The sweep's Optuna study, as the log of Optuna's JournalStorage (app/sweeps/study.py): replaying it
# rebuilds the study in any process, so a sweep outlives the server that started it.
sweep_log = Table(
    "sweep_log", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("sweep_id", Integer, ForeignKey("sweeps.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("entry", JSON, nullable=False),
    UniqueConstraint("sweep_id", "seq", name="uq_sweep_log_seq"),
)


# Prometheus counters and histogram buckets (app/db/counting.py): a series (name, labels as sorted compact JSON)
# and its value, added to in the transaction of the event it counts, so it only grows whatever later
# happens to the jobs' rows (a retry, a deletion).
counters = Table(
    "counters", metadata,
    Column("name", String(100), primary_key=True),
    Column("labels", String(500), primary_key=True),
    Column("value", Float, nullable=False),
)


# What the stored objects of each kind (app/lifecycle/collector.py's KINDS) came to at the collector's last listing;
# kind "cache" is the collecting host's copies of bucket objects.
storage_usage = Table(
    "storage_usage", metadata,
    Column("kind", String(16), primary_key=True),
    Column("bytes", BigInteger, nullable=False),
    Column("objects", BigInteger, nullable=False),
    Column("measured_at", Float, nullable=False),
)


# Who is asking (app/accounts/__init__.py): users, in projects; each bearer token names one user and (but an admin's)
# one
# project, and is stored as its SHA-256 only. A project's share weighs it in the fair share of devices, its limits
# bound what it holds at once ({"devices", "gpu_memory_gb", "queued_jobs", "running_sweeps", "stored_bytes"}).
projects = Table(
    "projects", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("share", Float, nullable=False, default=1.0),
    Column("limits", JSON),
    Column("created_at", Float, nullable=False),
    sqlite_autoincrement=True,
)

users = Table(
    "users", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("admin", Boolean, nullable=False, default=False),
    Column("created_at", Float, nullable=False),
    sqlite_autoincrement=True,
)

members = Table(
    "members", metadata,
    Column("user_id", Integer, ForeignKey("users.id", ondelete="CASCADE"), primary_key=True),
    Column("project_id", Integer, ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True),
)

tokens = Table(
    "tokens", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("digest", String(64), nullable=False, unique=True),
    Column("user_id", Integer, ForeignKey("users.id", ondelete="CASCADE"), nullable=False, index=True),
    Column("project_id", Integer, ForeignKey("projects.id", ondelete="CASCADE")),
    Column("label", String(200)),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
    # When it stops working (database clock, epoch seconds); NULL: never, until revoked.
    Column("expires_at", Float),
    sqlite_autoincrement=True,
)

# The dashboard's sign-ins (app/accounts/signins.py): the browser's cookie holds a session's id, kept here as its
# SHA-256
# only. token_digest is the digest of the token it signed in with (a tokens row's, or TRAINYARD_API_TOKEN's): that
# token is checked afresh on every request, so revoking it, its expiry or its user's deletion ends the session.
sessions = Table(
    "sessions", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("digest", String(64), nullable=False, unique=True),
    Column("token_digest", String(64), nullable=False, index=True),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    sqlite_autoincrement=True,
)

# Who did what, when, from where (app/accounts/audit.py): only ever appended to.
audit = Table(
    "audit", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("actor", String(100), nullable=False),
    Column("project", String(100)),
    Column("action", String(32), nullable=False, index=True),
    Column("target", String(200)),
    Column("detail", JSON),
    Column("client", String(100)),
    sqlite_autoincrement=True,
)

# The bytes and objects each project holds in the store, at the collector's last listing
# (app/lifecycle/collector.py): what
# a project's stored_bytes limit is checked against.
project_usage = Table(
    "project_usage", metadata,
    Column("project_id", Integer, primary_key=True),
    Column("bytes", BigInteger, nullable=False),
    Column("objects", BigInteger, nullable=False),
    Column("measured_at", Float, nullable=False),
)

# Each Slurm allocation asked for a job (app/clusters/agent.py): the job's claim it served (NULL: none), how it ended.
slurm_allocations = Table(
    "slurm_allocations", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", Integer, ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True),
    Column("slurm_id", String(64)), Column("partition", String(64)), Column("nodes", String(2000)),
    Column("state", String(32), nullable=False), Column("reason", String(200)), Column("claim", Integer),
    Column("asked_at", Float, nullable=False), Column("started_at", Float), Column("ended_at", Float, index=True),
    Column("outcome", String(500)),
)
