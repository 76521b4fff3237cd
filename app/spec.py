"""The job spec: everything a client may submit, validated here once for the API and again by the worker.

This module is the single source of truth for job kinds, architectures, datasets, devices and the
limits on every field. It imports neither torch nor FastAPI, so the API server stays light.
"""
import math
import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

# Architectures built by worker/nets.py, plus torchvision.models classifiers by name.
ARCHS = ("mlp", "cnn", "cifar_net")
# torchvision.models classifiers that build without downloading anything (weights=None).
# tests/test_nets.py checks this list against torchvision.models.list_models().
TORCHVISION_ARCHS = (
    "alexnet", "convnext_tiny", "convnext_small", "densenet121", "densenet161", "densenet169",
    "efficientnet_b0", "efficientnet_b1", "efficientnet_v2_s", "googlenet", "mnasnet0_5",
    "mnasnet1_0", "mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "regnet_x_400mf",
    "regnet_y_400mf", "resnet18", "resnet34", "resnet50", "resnet101", "resnext50_32x4d",
    "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "squeezenet1_0", "squeezenet1_1", "swin_t",
    "vgg11", "vgg11_bn", "vgg16", "vit_b_16", "wide_resnet50_2",
)
ALL_ARCHS = ARCHS + TORCHVISION_ARCHS

DATASETS = ("iris", "digits", "mnist", "fashion_mnist", "cifar10", "fake")
UPLOAD_PREFIX = "upload:"
ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid", "leaky_relu", "silu")
DEVICE_PATTERN = r"^(auto|cpu|cuda|cuda:[0-9]{1,2})$"
_UPLOAD_ID = re.compile(r"^[a-z0-9]{1,64}$")

JOB_KINDS = ("train", "predict")
JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATES = ("succeeded", "failed", "cancelled")

MAX_PREDICT_ROWS = 10_000
MAX_ID = 2**53


class _Strict(BaseModel):
    # Unknown fields are refused rather than silently ignored: a typo like "epoch" must not
    # quietly train with the default. NaN and infinities are refused everywhere.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def check_dataset(name: str) -> str:
    if name in DATASETS:
        return name
    if name.startswith(UPLOAD_PREFIX) and _UPLOAD_ID.match(name[len(UPLOAD_PREFIX):]):
        return name
    raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)} or upload:<id>")


class ModelSpec(_Strict):
    arch: str = Field(description="mlp, cnn, cifar_net or a torchvision.models classifier name")
    hidden: list[Annotated[int, Field(ge=1, le=65536)]] | None = Field(
        None, max_length=16, description="mlp: hidden layer sizes (default [64])")
    activation: Literal[ACTIVATIONS] = "relu"  # type: ignore[valid-type]
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    channels: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(
        None, min_length=1, max_length=8, description="cnn: channels of each conv block (default [32, 64])")
    kernel_size: int = Field(3, ge=1, le=11, description="cnn: kernel size")
    batch_norm: bool = Field(True, description="cnn: batch norm after each conv")
    num_classes: int | None = Field(None, ge=2, le=100_000, description="output size (default: from the dataset)")

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str) -> str:
        if v not in ALL_ARCHS:
            raise ValueError(f"unknown architecture {v!r}; valid: {', '.join(ALL_ARCHS)}")
        return v

    @model_validator(mode="after")
    def _fields_fit_arch(self):
        if self.hidden is not None and self.arch != "mlp":
            raise ValueError("model.hidden applies to arch 'mlp' only")
        if self.channels is not None and self.arch != "cnn":
            raise ValueError("model.channels applies to arch 'cnn' only")
        return self


class DataSpec(_Strict):
    dataset: str = Field(description="iris, digits, mnist, fashion_mnist, cifar10, fake or upload:<id>")
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0,
                                description="share held out for validation (datasets without a test split)")
    split_seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the train/validation split")
    image_size: tuple[Annotated[int, Field(ge=1, le=4)], Annotated[int, Field(ge=4, le=512)],
                      Annotated[int, Field(ge=4, le=512)]] = Field(
        (3, 32, 32), description="fake: channels, height, width")
    num_classes: int = Field(10, ge=2, le=1000, description="fake: number of classes")
    size: int = Field(1000, ge=10, le=200_000, description="fake: number of samples")

    _dataset = field_validator("dataset")(classmethod(lambda cls, v: check_dataset(v)))


class TrainParams(_Strict):
    epochs: int = Field(10, ge=1, le=10_000)
    batch_size: int = Field(64, ge=1, le=65_536)
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd only")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    checkpoint_every: int = Field(1, ge=0, le=10_000, description="epochs between checkpoints; 0 turns them off")
    # Speed switches. Each falls back cleanly where it does not apply (the job reports what it used).
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast precision; fp16 adds a grad scaler")
    tf32: bool = Field(True, description="TensorFloat-32 matmuls and convolutions on Ampere+ GPUs")
    cudnn_benchmark: bool = Field(True, description="let cuDNN pick the fastest conv algorithms")
    channels_last: bool = Field(False, description="channels_last memory format for conv nets")
    compile: bool = Field(False, description="torch.compile the model")


class _JobBase(_Strict):
    name: str | None = Field(None, max_length=200)
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto, cpu, cuda or cuda:N")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    max_attempts: int = Field(3, ge=1, le=100, description="runs lost to infrastructure failures before giving up")
    timeout_s: float | None = Field(None, gt=0, le=30 * 86400, description="stop and fail the job after this long")


class TrainJob(_JobBase):
    kind: Literal["train"]
    model: ModelSpec
    data: DataSpec
    train: TrainParams = TrainParams()


class PredictData(_Strict):
    dataset: str
    split: Literal["train", "val", "all"] = "val"
    val_fraction: float | None = Field(None, gt=0.0, lt=1.0, description="default: the training job's")
    split_seed: int | None = Field(None, ge=0, le=2**32 - 1, description="default: the training job's")

    _dataset = field_validator("dataset")(classmethod(lambda cls, v: check_dataset(v)))


class PredictJob(_JobBase):
    kind: Literal["predict"]
    model_job: int = Field(ge=1, le=MAX_ID, description="id of a succeeded train job")
    inputs: list[list[float]] | None = Field(
        None, min_length=1, max_length=MAX_PREDICT_ROWS,
        description="rows of features; image inputs flattened (C*H*W values per row)")
    data: PredictData | None = None
    batch_size: int = Field(1024, ge=1, le=65_536)

    @model_validator(mode="after")
    def _inputs_or_data(self):
        if (self.inputs is None) == (self.data is None):
            raise ValueError("give exactly one of inputs or data")
        if self.inputs is not None:
            widths = {len(row) for row in self.inputs}
            if len(widths) != 1 or 0 in widths:
                raise ValueError("inputs: every row must have the same, non-zero number of values")
            if not all(math.isfinite(v) for row in self.inputs for v in row):
                raise ValueError("inputs: values must be finite numbers")
        return self


JobSpec = Annotated[Union[TrainJob, PredictJob], Field(discriminator="kind")]
job_spec_adapter: TypeAdapter = TypeAdapter(JobSpec)


def parse_spec(raw: dict) -> TrainJob | PredictJob:
    """Re-validate a stored spec (the worker does this before running it)."""
    return job_spec_adapter.validate_python(raw)


TRAIN_EXAMPLE = {
    "kind": "train", "name": "iris-mlp",
    "model": {"arch": "mlp", "hidden": [8, 9]},
    "data": {"dataset": "iris", "val_fraction": 0.2, "split_seed": 33},
    "train": {"epochs": 100, "batch_size": 120, "optimizer": "adam", "lr": 0.01, "seed": 32},
    "device": "auto",
}
PREDICT_INPUTS_EXAMPLE = {"kind": "predict", "model_job": 1, "inputs": [[5.1, 3.5, 1.4, 0.2]]}
PREDICT_DATA_EXAMPLE = {"kind": "predict", "model_job": 1, "data": {"dataset": "iris", "split": "val"}}


# Built-in datasets: what a client can discover through GET /catalog.
DATASET_INFO = {
    "iris": {"source": "shipped", "input_shape": [4], "classes": 3, "samples": 150,
             "split": "val_fraction/split_seed (as sklearn's train_test_split)"},
    "digits": {"source": "shipped", "input_shape": [1, 8, 8], "classes": 10, "samples": 1797,
               "split": "val_fraction/split_seed"},
    "mnist": {"source": "torchvision (downloaded into the data dir)", "input_shape": [1, 28, 28], "classes": 10,
              "samples": 70000, "split": "official train / test"},
    "fashion_mnist": {"source": "torchvision (downloaded into the data dir)", "input_shape": [1, 28, 28],
                      "classes": 10, "samples": 70000, "split": "official train / test"},
    "cifar10": {"source": "torchvision (downloaded into the data dir)", "input_shape": [3, 32, 32], "classes": 10,
                "samples": 60000, "split": "official train / test"},
    "fake": {"source": "torchvision FakeData", "input_shape": "data.image_size", "classes": "data.num_classes",
             "samples": "data.size", "split": "val_fraction/split_seed",
             "params": ["image_size", "num_classes", "size"]},
}
ARCH_INFO = {
    "mlp": {"params": ["hidden", "activation", "dropout", "num_classes"], "inputs": "any (flattened)"},
    "cnn": {"params": ["channels", "kernel_size", "batch_norm", "activation", "dropout", "num_classes"],
            "inputs": "images (C, H, W)"},
    "cifar_net": {"params": ["num_classes"], "inputs": "images (C, 32, 32)"},
}


def catalog() -> dict:
    """Everything a client may put in a job, with the limits, derived from the models above."""
    archs = [{"name": name, **ARCH_INFO[name]} for name in ARCHS]
    archs += [{"name": name, "source": "torchvision.models", "params": ["num_classes"],
               "inputs": "images (C, H, W); 1-channel images are expanded to 3"} for name in TORCHVISION_ARCHS]
    return {
        "architectures": archs,
        "datasets": [{"name": name, **info} for name, info in DATASET_INFO.items()]
        + [{"name": "upload:<id>", "source": "POST /datasets"}],
        "activations": list(ACTIVATIONS),
        "devices": ["auto", "cpu", "cuda", "cuda:N"],
        "schemas": {"train": TrainJob.model_json_schema(), "predict": PredictJob.model_json_schema()},
    }
