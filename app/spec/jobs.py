"""The three kinds of job a client may submit (train, predict, run), what they share (device, priority,
attempts, timeout, resources), and parse_spec, which re-validates a stored one."""
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter, field_validator, model_validator

from trainyard.app.core import device_names
from trainyard.app.core.plugins import NAME as PLUGIN_NAME
from trainyard.app.spec.common import DATASET_INFO, Params, ShownName, _bounded_params, _Strict, check_dataset
from trainyard.app.spec.slurm import SlurmRequest
from trainyard.app.spec.train import DataSpec, ModelSpec, TrainParams

JOB_KINDS = ("train", "predict", "run")
DEVICE_PATTERN = device_names.PATTERN
MAX_PREDICT_ROWS = 10_000
# Devices one job may span (ranks, on one host or spread over several), and hosts it may spread over.
MAX_DEVICES = 16
MAX_HOSTS = 8
# Ids are the tables' INTEGER (32-bit on PostgreSQL): a larger one is a 422, never a query that fails.
MAX_ID = 2**31 - 1
# Jobs one job may wait for (`after`), and jobs one batch may submit (POST /jobs/batch).
MAX_AFTER = 32
MAX_BATCH = 32
# "$N": the job at position N of the same batch (POST /jobs/batch), before it has an id.
BATCH_REF = r"^\$(0|[1-9][0-9]?)$"
JobId = Annotated[int, Field(ge=1, le=MAX_ID)]
JobRef = JobId | Annotated[str, Field(pattern=BATCH_REF)]
# "sweep:<id>:best": a sweep's best trial, once the sweep ends (model_job and init_from).
SWEEP_BEST = r"^sweep:[1-9][0-9]{0,9}:best$"


def _sweep_id_in_range(ref: str) -> str:
    # The id is looked up in the sweeps' INTEGER column: a larger one is a 422 here, not a query that fails.
    if int(ref.split(":")[1]) > MAX_ID:
        raise ValueError(f"a sweep's id is at most {MAX_ID}")
    return ref


SweepBest = Annotated[str, Field(pattern=SWEEP_BEST), AfterValidator(_sweep_id_in_range)]
ModelRef = JobRef | SweepBest
# Largest magnitude a float32 holds: inputs beyond it would overflow to inf in the model.
FLOAT32_MAX = 3.4028234663852886e38
# What a job process may report per epoch (ctx.report) and keep beside its model (ctx.save_model's meta):
# enforced in the job process, and again by its supervisor, which does not trust the job's code.
MAX_METRIC_KEYS = 100          # a report's own metrics (the allocator's memory stats come on top)
MAX_METRIC_NAME = 100          # characters of a metric's name
MAX_MODEL_META_BYTES = 64 << 10  # save_model's extra meta, as JSON
MAX_META_FILE_BYTES = 1 << 20    # a model's whole meta.json (its class names included): what a predict submit reads


class Resources(_Strict):
    gpu_memory_gb: float | None = Field(
        None, gt=0, le=4096, description="GPU memory the job needs (GB, 10^9 bytes): it runs on a GPU with that much "
        "unclaimed, beside other jobs that state theirs, and is held to it; without it a job has its GPU to itself")


class Tracking(_Strict):
    """Where a job's results go besides trainyard's own records: an MLflow run where the service names a tracking
    server (TRAINYARD_MLFLOW_TRACKING_URI; docs/observing.md, "MLflow")."""
    mlflow: bool = Field(True, description="false: this job is no MLflow run, even where the service tracks")
    experiment: ShownName | None = Field(None, min_length=1, description="the MLflow experiment of its run (made if "
                                         "missing); default: the service's TRAINYARD_MLFLOW_EXPERIMENT")
    register_model: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$", description="a train or "
                                       "run job that saves a model: register it under this name in MLflow's model "
                                       "registry (a new version of it) when the job succeeds")
    git_commit: str | None = Field(None, pattern=r"^[0-9a-f]{7,40}$", description="the commit of the code it runs: "
                                   "its run's mlflow.source.git.commit tag")


class _JobBase(_Strict):
    name: ShownName | None = None
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto, cpu, cuda or cuda:N")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    max_attempts: int = Field(3, ge=1, le=100, description="runs lost to infrastructure failures before giving up")
    timeout_s: float | None = Field(None, gt=0, le=30 * 86400, description="stop and fail the job after this long")
    resources: Resources | None = None
    tracking: Tracking | None = None
    after: list[JobRef] = Field(
        default_factory=list, max_length=MAX_AFTER, description="ids of jobs this one waits for: it stays queued "
        "until they all succeed, and fails (class dependency) if one fails, is cancelled or deleted; in a batch "
        "(POST /jobs/batch), \"$N\" is the batch's job at position N")
    runs_on: Literal["workers", "slurm"] | None = Field(
        None, description="where it runs: trainyard's own workers, or an allocation of its own in Slurm "
        "(docs/scaling-out.md); default: the service's (TRAINYARD_SLURM_DEFAULT)")
    slurm: SlurmRequest | None = Field(None, description="runs on Slurm with these of its own: partition, account, "
                                       "qos, time limit (the rest is the service's)")

    @model_validator(mode="after")
    def _slurm_runs_on_slurm(self):
        if self.slurm is not None:
            if self.runs_on == "workers":
                raise ValueError("slurm: a job with runs_on workers takes no Slurm fields")
            self.runs_on = "slurm"
        return self

    @field_validator("after")
    @classmethod
    def _after_unique(cls, v: list[int | str]) -> list[int | str]:
        if len(set(v)) != len(v):
            raise ValueError("after: name each job once")
        return v

    @field_validator("resources")
    @classmethod
    def _resources_fit_device(cls, v: Resources | None, info) -> Resources | None:
        if v is not None and v.gpu_memory_gb is not None and info.data.get("device") == "cpu":
            raise ValueError("gpu_memory_gb asks for a GPU; this job's device is cpu")
        return v

    @property
    def gpu_memory_bytes(self) -> int | None:
        gb = self.resources.gpu_memory_gb if self.resources else None
        return None if gb is None else int(gb * 1e9)

    @property
    def device_count(self) -> int:
        return getattr(self, "devices", 1)

    @property
    def host_count(self) -> int:
        return getattr(self, "hosts", 1)


class _MultiDevice(_JobBase):
    """Train and run jobs may span several devices (DistributedDataParallel, one process each), of one host or
    spread evenly over several."""
    devices: int = Field(1, ge=1, le=MAX_DEVICES, description="devices the job runs on, one process each "
                         "(DistributedDataParallel); train.batch_size is per device")
    hosts: int = Field(1, ge=1, le=MAX_HOSTS, description="hosts the devices are spread over, devices/hosts on "
                       "each (the workers of every host share the database and a bucket, and each host sets "
                       "TRAINYARD_NODE_ADDR, the address the others reach its ranks at)")

    @model_validator(mode="after")
    def _whole_devices(self):
        if self.devices > 1:
            if self.gpu_memory_bytes is not None:
                raise ValueError("devices: a multi-device job takes whole devices; drop resources.gpu_memory_gb")
            if self.device not in ("auto", "cpu", "cuda"):
                raise ValueError(f"devices: a job on {self.devices} devices names a kind of device "
                                 f"(auto, cpu or cuda), not one device ({self.device})")
        if self.hosts > self.devices:
            raise ValueError(f"hosts: a job on {self.devices} device(s) cannot span {self.hosts} hosts")
        if self.hosts > 1 and self.devices % self.hosts:
            raise ValueError(f"hosts: {self.devices} devices do not spread evenly over {self.hosts} hosts; "
                             "devices must be a multiple of hosts")
        return self


class TrainJob(_MultiDevice):
    kind: Literal["train"]
    model: ModelSpec
    data: DataSpec
    train: TrainParams = TrainParams()
    init_from: ModelRef | None = Field(
        None, description="id of a train job (or run job that saved a model) to start from: the same architecture, "
        "fields and input shape; a different num_classes re-makes the classifier head. A job still queued or "
        "running is waited for (as `after`); in a batch, \"$N\" is the batch's job at position N; "
        "\"sweep:<id>:best\" is a sweep's best trial, waited for until the sweep ends")

    @model_validator(mode="after")
    def _one_starting_point(self):
        if self.init_from is not None and self.model.weights is not None:
            raise ValueError("init_from and model.weights are two starting points; give one")
        return self

    @model_validator(mode="after")
    def _augment_fits_data(self):
        # Built-in datasets state their shape; an upload's or a plugin's is checked by the worker.
        shape = DATASET_INFO.get(self.data.dataset, {}).get("input_shape")
        if self.train.augment is not None and isinstance(shape, list) and len(shape) != 3:
            raise ValueError(f"train.augment applies to image datasets; {self.data.dataset} has samples of "
                             f"shape {shape}")
        return self


class PredictData(_Strict):
    dataset: str
    split: Literal["train", "val", "all"] = "val"
    val_fraction: float | None = Field(None, gt=0.0, lt=1.0, description="default: the training job's")
    split_seed: int | None = Field(None, ge=0, le=2**32 - 1, description="default: the training job's")
    params: Params

    _dataset = field_validator("dataset")(classmethod(lambda cls, v: check_dataset(v)))
    _params = field_validator("params")(classmethod(lambda cls, v: _bounded_params(v)))


class PredictJob(_JobBase):
    kind: Literal["predict"]
    model_job: ModelRef = Field(description="id of a train job (or run job that saved a model); one still queued or "
                                "running is waited for (as `after`); in a batch, \"$N\" is the batch's job at "
                                "position N; \"sweep:<id>:best\" is a sweep's best trial, waited for until it ends")
    inputs: list[list[float]] | None = Field(
        None, min_length=1, max_length=MAX_PREDICT_ROWS,
        description="rows of features; image inputs flattened (C*H*W values per row)")
    data: PredictData | None = None
    batch_size: int = Field(1024, ge=1, le=65_536)
    top_k: int | None = Field(None, ge=1, le=1000, description="inputs: return the k most likely classes per row "
                              "instead of every probability")

    @model_validator(mode="after")
    def _inputs_or_data(self):
        if self.tracking is not None and self.tracking.register_model is not None:
            raise ValueError("tracking.register_model: a predict job makes no model to register")
        if (self.inputs is None) == (self.data is None):
            raise ValueError("give exactly one of inputs or data")
        if self.inputs is not None:
            widths = {len(row) for row in self.inputs}
            if len(widths) != 1 or 0 in widths:
                raise ValueError("inputs: every row must have the same, non-zero number of values")
            if not all(math.isfinite(v) and abs(v) <= FLOAT32_MAX for row in self.inputs for v in row):
                raise ValueError(f"inputs: values must be finite numbers within float32's range "
                                 f"(|v| <= {FLOAT32_MAX:.4g})")
        elif self.top_k is not None:
            raise ValueError("top_k applies to inputs; an evaluation on data reports accuracy, not rows")
        return self


class RunJob(_MultiDevice):
    """Your own training program, installed on the workers as an entry point (trainyard.entrypoints)."""
    kind: Literal["run"]
    entrypoint: str = Field(description="an installed entrypoint plugin: fn(ctx, config) -> dict | None")
    config: dict[str, Any] = Field(default_factory=dict, description="passed to the entrypoint (JSON, at most 64 KiB, "
                                                                      "nested at most 32 deep)")
    epochs: int | None = Field(None, ge=1, le=1_000_000, description="progress denominator (or ctx.set_total)")

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_name(cls, v: str) -> str:
        if not PLUGIN_NAME.fullmatch(v):
            raise ValueError(f"{v[:100]!r} is not a plugin name (letters, digits, '_', '.', '-')")
        return v

    _config = field_validator("config")(classmethod(lambda cls, v: _bounded_params(v)))


JobSpec = Annotated[TrainJob | PredictJob | RunJob, Field(discriminator="kind")]
job_spec_adapter: TypeAdapter = TypeAdapter(JobSpec)
JobBatch = Annotated[list[JobSpec], Field(min_length=1, max_length=MAX_BATCH)]


def parse_spec(raw: dict) -> TrainJob | PredictJob | RunJob:
    """Re-validate a stored spec (the worker does this before running it)."""
    return job_spec_adapter.validate_python(raw)


TRAIN_EXAMPLE: dict[str, Any] = {
    "kind": "train", "name": "iris-mlp",
    "model": {"arch": "mlp", "hidden": [8, 9]},
    "data": {"dataset": "iris", "val_fraction": 0.2, "split_seed": 33},
    "train": {"epochs": 100, "batch_size": 120, "optimizer": "adam", "lr": 0.01, "seed": 32},
    "device": "auto",
}
PREDICT_INPUTS_EXAMPLE = {"kind": "predict", "model_job": 1, "inputs": [[5.1, 3.5, 1.4, 0.2]]}
PREDICT_DATA_EXAMPLE = {"kind": "predict", "model_job": 1, "data": {"dataset": "iris", "split": "val"}}
# POST /jobs/batch: train, evaluate the model on its held-out split, then predict rows with it.
PIPELINE_EXAMPLE = [TRAIN_EXAMPLE, {**PREDICT_DATA_EXAMPLE, "model_job": "$0"},
                    {**PREDICT_INPUTS_EXAMPLE, "model_job": "$0", "after": ["$1"]}]
