"""What a train job trains and how: the model, the data, and the training parameters (learning-rate schedule,
early stopping, augmentation, speed switches)."""
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from trainyard.app.core.plugins import NAME as PLUGIN_NAME
from trainyard.app.spec.common import DATASET_INFO, Params, _bounded_params, _Strict, check_dataset, is_plugin_dataset

# Architectures built by worker/nets.py, plus torchvision.models classifiers by name.
ARCHS = ("mlp", "cnn", "cifar_net")
# torchvision.models classifiers that build without downloading anything (weights=None).
# tests/worker/test_nets.py checks this list against torchvision.models.list_models().
TORCHVISION_ARCHS = (
    "alexnet", "convnext_tiny", "convnext_small", "densenet121", "densenet161", "densenet169",
    "efficientnet_b0", "efficientnet_b1", "efficientnet_v2_s", "googlenet", "mnasnet0_5",
    "mnasnet1_0", "mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "regnet_x_400mf",
    "regnet_y_400mf", "resnet18", "resnet34", "resnet50", "resnet101", "resnext50_32x4d",
    "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "squeezenet1_0", "squeezenet1_1", "swin_t",
    "vgg11", "vgg11_bn", "vgg16", "vit_b_16", "wide_resnet50_2",
)
ALL_ARCHS = ARCHS + TORCHVISION_ARCHS
# The fields of ModelSpec each built-in architecture uses (arch and num_classes apply to all);
# a stored spec keeps only those, so an MLP's record does not show a CNN's kernel size.
ARCH_FIELDS = {"mlp": ("hidden", "activation", "dropout"),
               "cnn": ("channels", "kernel_size", "batch_norm", "activation", "dropout"),
               "cifar_net": ()}
ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid", "leaky_relu", "silu")
# A torchvision weights enum member: DEFAULT, IMAGENET1K_V1, IMAGENET1K_SWAG_E2E_V1...
# (the worker checks the arch has it).
WEIGHTS_PATTERN = r"^[A-Z][A-Z0-9_]*$"
# FakeData decoded to uint8 (samples x C x H x W); training holds it again as float32.
MAX_FAKE_BYTES = 1 << 30


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
    dataset: str = Field(description="iris, digits, mnist, fashion_mnist, cifar10, fake, upload:<id> "
                         "or a dataset plugin")
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
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="autocast precision; "
                                                       "fp16 adds a grad scaler")
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
