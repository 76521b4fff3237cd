"""The job spec: everything a client may submit, validated here once for the API and again by the worker.

This module is the single source of truth for job kinds, architectures, datasets, devices and the
limits on every field. It imports neither torch nor FastAPI, so the API server stays light.
"""
import json
import math
import re
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)

from trainyard.app import device_names, text
from trainyard.app.plugins import NAME as PLUGIN_NAME

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

# Built-in datasets: what a client can discover through GET /catalog, and the pixel scaling the
# worker applies: (mean, std) of pixels scaled to 0..1, as transforms.Normalize does (one per
# channel alike). Adding a dataset is an entry here and a loader in worker/data.py.
DATASET_INFO = {
    "iris": {"source": "shipped", "input_shape": [4], "classes": 3, "samples": 150,
             "split": "val_fraction/split_seed (as sklearn's train_test_split)"},
    "digits": {"source": "shipped", "input_shape": [1, 8, 8], "classes": 10, "samples": 1797,
               "split": "val_fraction/split_seed", "scale": "0..16 -> 0..1"},
    "mnist": {"source": "torchvision (downloaded into the data dir)", "input_shape": [1, 28, 28], "classes": 10,
              "samples": 70000, "split": "official train / test", "pixel_norm": [0.1307, 0.3081]},
    "fashion_mnist": {"source": "torchvision (downloaded into the data dir)", "input_shape": [1, 28, 28],
                      "classes": 10, "samples": 70000, "split": "official train / test", "pixel_norm": [0.2860, 0.3530]},
    "cifar10": {"source": "torchvision (downloaded into the data dir)", "input_shape": [3, 32, 32], "classes": 10,
                "samples": 60000, "split": "official train / test", "pixel_norm": [0.5, 0.5]},
    "fake": {"source": "torchvision FakeData", "input_shape": "data.image_size", "classes": "data.num_classes",
             "samples": "data.size", "split": "val_fraction/split_seed", "pixel_norm": [0.5, 0.5],
             "params": ["image_size", "num_classes", "size"]},
}
DATASETS = tuple(DATASET_INFO)
# The fields of ModelSpec each built-in architecture uses (arch and num_classes apply to all);
# a stored spec keeps only those, so an MLP's record does not show a CNN's kernel size.
ARCH_FIELDS = {"mlp": ("hidden", "activation", "dropout"),
               "cnn": ("channels", "kernel_size", "batch_norm", "activation", "dropout"),
               "cifar_net": ()}
UPLOAD_PREFIX = "upload:"
ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid", "leaky_relu", "silu")
DEVICE_PATTERN = device_names.PATTERN
# A torchvision weights enum member: DEFAULT, IMAGENET1K_V1, IMAGENET1K_SWAG_E2E_V1... (the worker checks the arch has it).
WEIGHTS_PATTERN = r"^[A-Z][A-Z0-9_]*$"
_UPLOAD_ID = re.compile(r"[a-z0-9]{1,64}")

JOB_KINDS = ("train", "predict", "run")
# A plugin's parameters, or a run job's config: JSON of at most this many bytes.
MAX_PARAMS_BYTES = 64 << 10
# Free-form JSON a client sends (a run job's config, a plugin's params, a sweep's choice values) nests at
# most this deep: deeper values overflow the recursion of the serialisers downstream (a 500 at ~300).
MAX_JSON_DEPTH = 32

MAX_PREDICT_ROWS = 10_000
# Devices one job may span (ranks of one host).
MAX_DEVICES = 16
MAX_ID = 2**53
# Largest magnitude a float32 holds: inputs beyond it would overflow to inf in the model.
FLOAT32_MAX = 3.4028234663852886e38
# FakeData decoded to uint8 (samples x C x H x W); training holds it again as float32.
MAX_FAKE_BYTES = 1 << 30
# What a job process may report per epoch (ctx.report) and keep beside its model (ctx.save_model's meta):
# enforced in the job process, and again by its supervisor, which does not trust the job's code.
MAX_METRIC_KEYS = 100          # a report's own metrics (the allocator's memory stats come on top)
MAX_METRIC_NAME = 100          # characters of a metric's name
MAX_MODEL_META_BYTES = 64 << 10  # save_model's extra meta, as JSON
MAX_META_FILE_BYTES = 1 << 20    # a model's whole meta.json (its class names included): what a predict submit reads


def _no_control_chars(v: str) -> str:
    if found := text.first_control(v):  # a terminal would act on it (ESC ] 52 sets the clipboard)
        raise ValueError(f"{found}: a name is shown on terminals, which act on control characters")
    return v


# A job's or a sweep's name, a sweep's parameter path: shown by the CLI and the dashboard.
ShownName = Annotated[str, Field(max_length=200), AfterValidator(_no_control_chars)]


class _Strict(BaseModel):
    # Unknown fields are refused rather than silently ignored: a typo like "epoch" must not
    # quietly train with the default. NaN and infinities are refused everywhere. Strict types:
    # "5" is not an integer and true is not a number (an integer is still a valid float).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def check_dataset(name: str) -> str:
    """A built-in dataset, an upload, or a name a plugin may have (whether one does is checked at submit)."""
    if name in DATASETS or PLUGIN_NAME.fullmatch(name):
        return name
    if check_upload(name):
        return name
    raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}, upload:<id> or a dataset plugin")


def uploads_named(spec: Any) -> set[str]:
    """The ids of the uploads a stored spec names as a dataset, wherever it names one."""
    if isinstance(spec, dict):
        found = {spec["dataset"][len(UPLOAD_PREFIX):]} if isinstance(spec.get("dataset"), str) and \
            check_upload(spec["dataset"]) else set()
        return found.union(*(uploads_named(v) for v in spec.values()))
    if isinstance(spec, list):
        return set().union(*(uploads_named(v) for v in spec))
    return set()


def check_upload(name: str) -> bool:
    return name.startswith(UPLOAD_PREFIX) and bool(_UPLOAD_ID.fullmatch(name[len(UPLOAD_PREFIX):]))


def is_plugin_dataset(name: str) -> bool:
    return name not in DATASETS and not name.startswith(UPLOAD_PREFIX)


def json_depth(value: Any) -> int:
    """How deep lists and objects nest in a JSON value (a scalar: 0, [1]: 1), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return deepest  # deep enough to refuse: no need to walk the rest
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_depth(value: Any) -> Any:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nests lists or objects more than {MAX_JSON_DEPTH} deep")
    return value


def _bounded_params(v: dict | None) -> dict | None:
    if v is not None and len(json.dumps(check_depth(v))) > MAX_PARAMS_BYTES:
        raise ValueError(f"is over {MAX_PARAMS_BYTES // 1024} KiB of JSON")
    return v


Params = Annotated[dict[str, Any] | None, Field(None, description="a plugin's keyword arguments (JSON, at most 64 KiB, "
                                                                "nested at most 32 deep)")]


class ModelSpec(_Strict):
    arch: str = Field(description="mlp, cnn, cifar_net, a torchvision.models classifier name, or a model plugin")
    params: Params
    hidden: list[Annotated[int, Field(ge=1, le=65536)]] | None = Field(
        None, max_length=16, description="mlp: hidden layer sizes (default [64])")
    activation: Literal[ACTIVATIONS] = "relu"  # type: ignore[valid-type]
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    channels: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(
        None, min_length=1, max_length=8, description="cnn: channels of each conv block (default [32, 64])")
    kernel_size: int = Field(3, ge=1, le=11, description="cnn: kernel size")
    batch_norm: bool = Field(True, description="cnn: batch norm after each conv")
    num_classes: int | None = Field(None, ge=2, le=100_000, description="output size (default: from the dataset)")
    weights: str | None = Field(
        None, pattern=WEIGHTS_PATTERN, max_length=64, description="torchvision archs: published weights to start "
        "from, DEFAULT or a name of the arch's weights enum (IMAGENET1K_V1...), read from TORCH_HOME's cache")

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str) -> str:
        # A plugin's name is checked at submit against what the workers have installed.
        if v not in ALL_ARCHS and not PLUGIN_NAME.fullmatch(v):
            raise ValueError(f"unknown architecture {v!r}; valid: {', '.join(ALL_ARCHS)} or a model plugin")
        return v

    _params = field_validator("params")(classmethod(lambda cls, v: _bounded_params(v)))

    @property
    def is_plugin(self) -> bool:
        return self.arch not in ALL_ARCHS

    @model_validator(mode="after")
    def _fields_fit_arch(self):
        if self.is_plugin and (self.hidden is not None or self.channels is not None):
            raise ValueError(f"unknown architecture {self.arch!r}; valid: {', '.join(ALL_ARCHS)}, or a model plugin "
                             "(which takes `params`, not `hidden` or `channels`)")
        if self.hidden is not None and self.arch != "mlp":
            raise ValueError("model.hidden applies to arch 'mlp' only")
        if self.channels is not None and self.arch != "cnn":
            raise ValueError("model.channels applies to arch 'cnn' only")
        if self.params is not None and not self.is_plugin:
            raise ValueError("model.params applies to model plugins; built-in architectures have fields of their own")
        if self.weights is not None and self.arch not in TORCHVISION_ARCHS:
            raise ValueError("model.weights applies to torchvision architectures; other models start from "
                             "another job's weights with init_from")
        return self

    @model_serializer(mode="wrap")
    def _applicable(self, handler):
        own = ("params",) if self.is_plugin else ARCH_FIELDS.get(self.arch, ("weights",))  # torchvision: weights
        used = ("arch", "num_classes", *own)
        return {k: v for k, v in handler(self).items() if k in used}


class DataSpec(_Strict):
    dataset: str = Field(description="iris, digits, mnist, fashion_mnist, cifar10, fake, upload:<id> or a dataset plugin")
    params: Params
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0,
                                description="share held out for validation (datasets without a test split)")
    split_seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the train/validation split")
    image_size: list[Annotated[int, Field(ge=1, le=512)]] = Field(
        [3, 32, 32], min_length=3, max_length=3, description="fake: channels (1-4), height, width (4-512)")
    num_classes: int = Field(10, ge=2, le=1000, description="fake: number of classes")
    size: int = Field(1000, ge=10, le=200_000, description="fake: number of samples")

    _dataset = field_validator("dataset")(classmethod(lambda cls, v: check_dataset(v)))
    _params = field_validator("params")(classmethod(lambda cls, v: _bounded_params(v)))

    @model_validator(mode="after")
    def _params_fit_dataset(self):
        if self.params is not None and not is_plugin_dataset(self.dataset):
            raise ValueError("data.params applies to dataset plugins")
        return self

    @model_serializer(mode="wrap")
    def _applicable(self, handler):
        fake_only = DATASET_INFO["fake"]["params"]
        plugin = is_plugin_dataset(self.dataset)
        return {k: v for k, v in handler(self).items()
                if (self.dataset == "fake" or k not in fake_only) and (plugin or k != "params")}

    @field_validator("image_size")
    @classmethod
    def _image_size(cls, v: list[int]) -> list[int]:
        c, h, w = v
        if not 1 <= c <= 4 or not (4 <= h <= 512 and 4 <= w <= 512):
            raise ValueError("image_size is [channels 1-4, height 4-512, width 4-512]")
        return v

    @model_validator(mode="after")
    def _fake_fits(self):
        if self.dataset == "fake":
            c, h, w = self.image_size
            if self.size * c * h * w > MAX_FAKE_BYTES:
                raise ValueError(f"fake data of {self.size} images of {c}x{h}x{w} is "
                                 f"{self.size * c * h * w / 2**30:.1f} GiB; the limit is "
                                 f"{MAX_FAKE_BYTES / 2**30:.0f} GiB (lower size or image_size)")
        return self


VAL_METRICS = ("val_loss", "val_accuracy")
# Whether a validation metric improves upward or downward.
HIGHER_IS_BETTER = {"val_loss": False, "val_accuracy": True}


class Schedule(_Strict):
    """How the learning rate moves over the run, per optimizer step. `lr` is the peak."""
    name: Literal["constant", "cosine", "linear", "step", "onecycle"] = Field(
        description="constant; cosine or linear decay from lr to min_lr; step: lr x gamma every step_epochs; "
        "onecycle: torch's OneCycleLR with max_lr = lr")
    warmup_epochs: float = Field(0.0, ge=0.0, le=10_000, description="linear warm-up from 0 to lr over this many "
                                 "epochs (onecycle: its rising phase, default 30% of the run)")
    min_lr: float = Field(0.0, ge=0.0, le=10.0, description="cosine, linear: the last step's learning rate")
    step_epochs: int = Field(30, ge=1, le=10_000, description="step: epochs between decays")
    gamma: float = Field(0.1, gt=0.0, le=1.0, description="step: the factor of each decay")

    @model_serializer(mode="wrap")
    def _applicable(self, handler):
        used = {"constant": (), "cosine": ("min_lr",), "linear": ("min_lr",), "step": ("step_epochs", "gamma"),
                "onecycle": ()}[self.name]
        return {k: v for k, v in handler(self).items() if k in ("name", "warmup_epochs", *used)}


class EarlyStopping(_Strict):
    metric: Literal[VAL_METRICS] = Field("val_loss", description="the validation metric watched")  # type: ignore[valid-type]
    patience: int = Field(5, ge=1, le=10_000, description="evaluations without improvement before stopping")
    min_delta: float = Field(0.0, ge=0.0, le=1e6, description="the smallest change that counts as improvement")


class Augment(_Strict):
    """Augmentation of each training batch on its device (worker/augment.py), for images (C x H x W) only.
    Padding adds zeros of the normalised input (the dataset's mean pixel), as torchvision's
    RandomCrop(padding) on normalised tensors does."""
    crop_padding: int = Field(4, ge=0, le=64, description="pixels of zero padding on each side before a random "
                              "crop back to the original size; 0: no crop")
    horizontal_flip: bool = Field(True, description="flip each image left to right with probability 1/2")

    @model_validator(mode="after")
    def _does_something(self):
        if self.crop_padding == 0 and not self.horizontal_flip:
            raise ValueError("train.augment with crop_padding 0 and horizontal_flip false changes nothing; drop it")
        return self


class TrainParams(_Strict):
    epochs: int = Field(10, ge=1, le=10_000)
    batch_size: int = Field(64, ge=1, le=65_536)
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd only")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    checkpoint_every: int = Field(1, ge=0, le=10_000, description="epochs between checkpoints; 0 turns them off")
    checkpoint_every_s: float = Field(10.0, ge=0.0, le=86_400, description="and at least this many seconds since "
                                      "the last one (0: every checkpoint_every epochs); a crash costs at most this "
                                      "plus an epoch, a stop request none")
    # How the model is fitted. Each default keeps a plain fixed-lr loop.
    lr_schedule: Schedule | None = Field(None, description="learning-rate schedule (default: lr throughout)")
    grad_clip_norm: float | None = Field(None, gt=0.0, le=1e6, description="clip the gradients' global L2 norm")
    accumulate_steps: int = Field(1, ge=1, le=1024, description="batches whose gradients make one optimizer step "
                                  "(effective batch = batch_size x accumulate_steps x devices)")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="of the training loss (validation loss is plain)")
    eval_every: int = Field(1, ge=1, le=10_000, description="epochs between validations (the last epoch always)")
    early_stopping: EarlyStopping | None = Field(None, description="stop when a validation metric stops improving")
    keep: Literal["last", "best"] = Field("last", description="the artifact: the last epoch's weights, or the best "
                                          "evaluated epoch's by keep_metric")
    keep_metric: Literal[VAL_METRICS] = Field("val_loss", description="keep best: by this metric")  # type: ignore[valid-type]
    # Speed switches. Each falls back cleanly where it does not apply (the job reports what it used).
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast precision; fp16 adds a grad scaler")
    tf32: bool = Field(True, description="TensorFloat-32 matmuls and convolutions on Ampere+ GPUs")
    # Before cudnn_benchmark: its validator reads this one.
    deterministic: bool = Field(False, description="deterministic algorithms only (torch.use_deterministic_"
                                "algorithms, cuDNN's autotuner off): a resumed CUDA run then repeats bit for bit, "
                                "at some speed; an op with no deterministic kernel fails the job, naming it")
    cudnn_benchmark: bool = Field(True, description="let cuDNN pick the fastest conv algorithms (off with "
                                  "deterministic)")
    channels_last: bool = Field(False, description="channels_last memory format for conv nets")
    compile: bool = Field(False, description="torch.compile the model")
    augment: Augment | None = Field(None, description="image augmentation of the training batches: random crop "
                                    "with padding, horizontal flip (image datasets only; default: none)")

    @field_validator("cudnn_benchmark")
    @classmethod
    def _not_with_deterministic(cls, v: bool, info) -> bool:
        # Only an explicit true: by default the autotuner is simply off in a deterministic job.
        if v and info.data.get("deterministic"):
            raise ValueError("cuDNN's autotuner picks algorithms per run: cudnn_benchmark true and deterministic "
                             "true cannot both hold; drop cudnn_benchmark")
        return v

    @model_validator(mode="after")
    def _deterministic_without_autotuner(self):
        if self.deterministic:
            self.cudnn_benchmark = False
        return self

    @model_serializer(mode="wrap")
    def _applicable(self, handler):
        return {k: v for k, v in handler(self).items() if (k != "momentum" or self.optimizer == "sgd")
                and (k != "keep_metric" or self.keep == "best")}


class Resources(_Strict):
    gpu_memory_gb: float | None = Field(
        None, gt=0, le=4096, description="GPU memory the job needs (GB, 10^9 bytes): it runs on a GPU with that much "
        "unclaimed, beside other jobs that state theirs, and is held to it; without it a job has its GPU to itself")


class _JobBase(_Strict):
    name: ShownName | None = None
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto, cpu, cuda or cuda:N")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    max_attempts: int = Field(3, ge=1, le=100, description="runs lost to infrastructure failures before giving up")
    timeout_s: float | None = Field(None, gt=0, le=30 * 86400, description="stop and fail the job after this long")
    resources: Resources | None = None

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


class _MultiDevice(_JobBase):
    """Train and run jobs may span several devices of one host (DistributedDataParallel, one process each)."""
    devices: int = Field(1, ge=1, le=MAX_DEVICES, description="devices of one host the job runs on, one process "
                         "each (DistributedDataParallel); train.batch_size is per device")

    @model_validator(mode="after")
    def _whole_devices(self):
        if self.devices > 1:
            if self.gpu_memory_bytes is not None:
                raise ValueError("devices: a multi-device job takes whole devices; drop resources.gpu_memory_gb")
            if self.device not in ("auto", "cpu", "cuda"):
                raise ValueError(f"devices: a job on {self.devices} devices names a kind of device "
                                 f"(auto, cpu or cuda), not one device ({self.device})")
        return self


class TrainJob(_MultiDevice):
    kind: Literal["train"]
    model: ModelSpec
    data: DataSpec
    train: TrainParams = TrainParams()
    init_from: int | None = Field(
        None, ge=1, le=MAX_ID, description="id of a succeeded train job (or run job that saved a model) to start from: "
        "the same architecture, fields and input shape; a different num_classes re-makes the classifier head")

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
    model_job: int = Field(ge=1, le=MAX_ID, description="id of a succeeded train job (or run job that saved a model)")
    inputs: list[list[float]] | None = Field(
        None, min_length=1, max_length=MAX_PREDICT_ROWS,
        description="rows of features; image inputs flattened (C*H*W values per row)")
    data: PredictData | None = None
    batch_size: int = Field(1024, ge=1, le=65_536)
    top_k: int | None = Field(None, ge=1, le=1000,
                              description="inputs: return the k most likely classes per row instead of every probability")

    @model_validator(mode="after")
    def _inputs_or_data(self):
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


def parse_spec(raw: dict) -> TrainJob | PredictJob | RunJob:
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


ARCH_INPUTS = {"mlp": "any (flattened)", "cnn": "images (C, H, W)", "cifar_net": "images (C, 32, 32)"}


def catalog(plugins: list[dict] | None = None) -> dict:
    """Everything a client may put in a job, with the limits, derived from the models above; plugins:
    those installed on this server or on live workers (kind, name, distribution, version, where)."""
    archs = [{"name": name, "params": [*ARCH_FIELDS[name], "num_classes"], "inputs": ARCH_INPUTS[name]}
             for name in ARCHS]
    archs += [{"name": name, "source": "torchvision.models", "params": ["num_classes", "weights"],
               "inputs": "images (C, H, W); 1-channel images are expanded to 3"} for name in TORCHVISION_ARCHS]
    return {
        "architectures": archs,
        "datasets": [{"name": name, **info} for name, info in DATASET_INFO.items()]
        + [{"name": "upload:<id>", "source": "POST /datasets"}],
        "activations": list(ACTIVATIONS),
        "devices": list(device_names.JOB_DEVICES),
        "plugins": plugins or [],
        "schemas": {"train": TrainJob.model_json_schema(), "predict": PredictJob.model_json_schema(),
                    "run": RunJob.model_json_schema()},
    }


# ---- sweeps: a search over a job's fields (app/search.py runs them) ------------------------------

SWEEP_METHODS = ("grid", "random", "tpe")
MAX_SWEEP_TRIALS = 1000
MAX_GRID_VALUES = 10_000  # a parameter's values the grid enumerates (an int range's length, say)
DEFAULT_TRIALS = 20  # a random or tpe sweep's trials without max_trials


def range_count(low: float, high: float, step: float) -> int:
    """How many values a stepped range holds, low and high included (1e-9: (0.3 - 0.1) / 0.1 < 2)."""
    return int(math.floor((high - low) / step + 1e-9)) + 1
# A sweep's choice values, all its parameters together: each is checked as a whole job at submit, and
# the study holds each trial's choice of them (app/search.py journals an index into them, not the value).
MAX_CHOICE_VALUES = 1000
MAX_CHOICE_BYTES = 256 << 10
# Steps of a float range with a step: Optuna counts them in 28-digit decimals, and a grid enumerates them.
MAX_RANGE_STEPS = 2**53
TRAIN_SWEEP_METRICS = ("val_loss", "val_accuracy", "train_loss")
# A path ends in a number, a number or anything (below a plugin's params or a run job's config), or else.
NUMBER, INTEGER, ANY, OTHER = "number", "integer", "any", "other"


class FloatParam(_Strict):
    type: Literal["float"]
    low: float
    high: float
    log: bool = Field(False, description="sample on a log scale (low > 0)")
    step: float | None = Field(None, gt=0, description="a grid of low, low + step, ... high")

    @model_validator(mode="after")
    def _range(self):
        _check_range(self.low, self.high, self.log, self.step)
        if not math.isfinite(self.high - self.low):
            raise ValueError(f"the range from {self.low} to {self.high} is wider than a float holds; narrow it")
        if self.step is not None and not (self.high - self.low) / self.step <= MAX_RANGE_STEPS:
            raise ValueError(f"step {self.step} makes over {MAX_RANGE_STEPS:,} steps from low to high; "
                             "take a larger step")
        return self


class IntParam(_Strict):
    type: Literal["int"]
    low: int = Field(ge=-2**53, le=2**53)
    high: int = Field(ge=-2**53, le=2**53)
    log: bool = Field(False, description="sample on a log scale (low >= 1)")
    step: int = Field(1, ge=1, le=2**53)

    @model_validator(mode="after")
    def _range(self):
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self


class ChoiceParam(_Strict):
    type: Literal["choice"]
    values: list[Any] = Field(min_length=1, max_length=MAX_CHOICE_VALUES,
                              description="the values to choose from: any JSON the field takes (lists too), "
                              "nested at most 32 deep")

    @field_validator("values")
    @classmethod
    def _distinct(cls, v: list) -> list:
        for i, x in enumerate(v):
            if json_depth(x) > MAX_JSON_DEPTH:
                raise ValueError(f"values[{i}] nests lists or objects more than {MAX_JSON_DEPTH} deep")
        encoded = [json.dumps(x, sort_keys=True) for x in v]
        if len(set(encoded)) != len(encoded):
            raise ValueError("values repeat; give each value once")
        return v


def _check_range(low, high, log, step) -> None:
    if not low <= high:
        raise ValueError(f"low ({low}) must not be above high ({high})")
    if log and low <= 0:
        raise ValueError("log scale needs low > 0")
    if log and step is not None:
        raise ValueError("a log-scale range takes no step")


SweepParam = Annotated[FloatParam | IntParam | ChoiceParam, Field(discriminator="type")]


class MedianPruner(_Strict):
    """Stop a trial whose metric at an epoch is worse than the median of earlier trials' at that epoch."""
    type: Literal["median"]
    startup_trials: int = Field(3, ge=0, le=MAX_SWEEP_TRIALS, description="trials that end before any is pruned")
    warmup_epochs: int = Field(1, ge=0, le=100_000, description="epochs a trial runs before any pruning decision")
    interval_epochs: int = Field(1, ge=1, le=100_000, description="epochs between pruning checks")


class AshaPruner(_Strict):
    """Asynchronous successive halving: at epochs min_epochs x reduction_factor^k a trial carries on only if
    it is in the best 1/reduction_factor of the trials that reached that epoch."""
    type: Literal["asha"]
    min_epochs: int = Field(1, ge=1, le=100_000, description="the first rung's epoch")
    reduction_factor: int = Field(3, ge=2, le=100, description="1 in reduction_factor trials is promoted")


PrunerSpec = Annotated[MedianPruner | AshaPruner, Field(discriminator="type")]
BaseJob = Annotated[TrainJob | RunJob, Field(discriminator="kind")]


class SweepSpec(_Strict):
    """A search over a base job's fields: each trial is the base job with the trial's values set."""
    name: ShownName | None = None
    job: BaseJob = Field(description="the base job: a train job or a run job")
    parameters: dict[ShownName, SweepParam] = Field(
        min_length=1, max_length=32, description="search space by dotted path into the job: train.lr, model.hidden, "
        "config.width (a run job's config)...")
    method: Literal[SWEEP_METHODS] = Field("tpe", description="grid: every combination; random; tpe: Optuna's "  # type: ignore[valid-type]
                                           "Tree-structured Parzen Estimator")
    metric: str = Field("val_loss", pattern=r"^[A-Za-z0-9_.\-]{1,100}$",
                        description="the per-epoch metric to optimise (train jobs: val_loss, val_accuracy, train_loss)")
    direction: Literal["minimize", "maximize"] | None = Field(
        None, description="default: maximize val_accuracy, minimize anything else")
    max_trials: int | None = Field(None, ge=1, le=MAX_SWEEP_TRIALS,
                                   description="trials to run (default: the grid's size, or 20)")
    max_concurrent: int = Field(4, ge=1, le=256, description="trials queued or running at once")
    pruner: PrunerSpec | None = Field(None, description="stop poor trials early (median rule or ASHA)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="the sampler's seed")
    startup_trials: int = Field(10, ge=1, le=MAX_SWEEP_TRIALS, description="tpe: random trials before the model "
                                "of good and bad settings guides the search")
    max_failed_trials: int = Field(5, ge=1, le=MAX_SWEEP_TRIALS, description="trials that fail (not pruned or "
                                   "cancelled) before the sweep gives up")

    @property
    def goal(self) -> str:
        """The direction: as given, or maximize for a metric that grows better (val_accuracy)."""
        return self.direction or ("maximize" if HIGHER_IS_BETTER.get(self.metric) else "minimize")

    @property
    def trials(self) -> int:
        """Trials to make: max_trials, 20 by default; a grid's size at most (each combination once)."""
        if self.method == "grid":
            return min(self.grid_size(), self.max_trials or MAX_SWEEP_TRIALS)
        return self.max_trials or DEFAULT_TRIALS

    def grid(self) -> dict[str, list]:
        """Every parameter's values, for the grid: choices, int ranges, and float ranges with a step."""
        out = {}
        for path, p in self.parameters.items():
            if isinstance(p, ChoiceParam):
                out[path] = p.values
                continue
            if p.log or (isinstance(p, FloatParam) and p.step is None):
                raise ValueError(f"parameters.{path}: a grid takes choices, int ranges and float ranges with a step; "
                                 "this range has no finite set of values")
            n = range_count(p.low, p.high, p.step)
            if n > MAX_GRID_VALUES:
                raise ValueError(f"parameters.{path}: {n:,} values is over the grid's {MAX_GRID_VALUES:,}")
            out[path] = [p.low + i * p.step for i in range(n)] if isinstance(p, IntParam) \
                else [round(p.low + i * p.step, 12) for i in range(n)]
        return out

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid().values())


def field_kind(path: str, job_kind: str) -> str:
    """What the field at a dotted path of a job holds (NUMBER, INTEGER, ANY, OTHER); ValueError if no such field."""
    model: Any = TrainJob if job_kind == "train" else RunJob
    parts = path.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None or part in ("kind", "name"):
            raise ValueError(f"{path!r} is not a field of a {job_kind} job"
                             + (f" (no {part!r} in {'.'.join(parts[:i]) or 'the job'})" if i else ""))
        inner = _unwrap(field.annotation)
        last = i == len(parts) - 1
        if last:
            return INTEGER if inner is int else NUMBER if inner is float else OTHER
        if get_origin(inner) is dict or inner is dict:
            if part not in ("params", "config"):
                break
            return ANY  # a plugin's params or a run job's config: free-form below this
        model = inner
    raise ValueError(f"{path!r} is not a field of a {job_kind} job")


def _unwrap(annotation):
    """X from Optional[X] and Annotated[X, ...]; a union of models stays a union (not walked)."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def with_params(job: dict, params: dict[str, Any]) -> dict:
    """The base job (its JSON) with each dotted path set to its value; missing objects on a path are made."""
    out = json.loads(json.dumps(job))
    for path, value in params.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return out
