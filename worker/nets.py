"""Architecture registry: ModelSpec + the data's input shape -> an nn.Module.

build_model is deterministic given the global RNG state, and is called again at inference to
rebuild the exact module whose state_dict was saved, so every wrapper here is part of the format.
"""
import math
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainyard.app.core import plugins
from trainyard.app.spec import TORCHVISION_ARCHS, ModelSpec
from trainyard.worker.errors import JobError

_ACTIVATIONS = {
    "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
    "leaky_relu": nn.LeakyReLU, "silu": nn.SiLU,
}


def build_model(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The model for spec; num_classes is the data's, spec.num_classes may widen the output."""
    if spec.num_classes is not None:
        if spec.num_classes < num_classes:
            raise JobError(f"model.num_classes is {spec.num_classes} but the data has {num_classes} classes")
        num_classes = spec.num_classes
    input_shape = tuple(input_shape)
    if spec.arch == "mlp":
        return _mlp(spec, input_shape, num_classes)
    if spec.arch == "cifar_net":
        if len(input_shape) != 3 or input_shape[1:] != (32, 32):
            raise JobError(f"cifar_net expects images of shape (C, 32, 32), got {input_shape}")
        return CifarNet(input_shape[0], num_classes)
    if spec.arch == "cnn":
        return _cnn(spec, input_shape, num_classes)
    if spec.arch in TORCHVISION_ARCHS:
        return _torchvision(spec.arch, input_shape, num_classes)
    return _plugin(spec, input_shape, num_classes)


def _plugin(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A model plugin: factory(input_shape, num_classes, **params) -> nn.Module."""
    try:
        factory = plugins.load("models", spec.arch)
    except LookupError as e:
        raise JobError(str(e)) from None
    model = factory(tuple(input_shape), num_classes, **(spec.params or {}))
    if not isinstance(model, nn.Module):
        raise JobError(f"model plugin {spec.arch!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_input(model: nn.Module, input_shape: tuple[int, ...], device: torch.device, arch: str) -> None:
    """One no-grad eval forward on two zero samples, so a size the architecture cannot take
    fails the job up front with a clear message instead of a shape error at the first step."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros((2, *input_shape), device=device))
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, AssertionError) as e:  # shape errors; torchvision asserts some
        raise JobError(f"architecture {arch!r} does not accept inputs of shape {tuple(input_shape)}: "
                       f"{str(e).splitlines()[0]}") from e
    finally:
        model.train(was_training)


def _mlp(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    # Layers are created in order fc1, fc2, ..., out: with the same seed this draws the same
    # initial weights as a hand-written nn.Module with attributes fc1, fc2, out built in that order.
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    width = math.prod(input_shape)
    for i, hidden in enumerate(spec.hidden or [64], start=1):
        layers[f"fc{i}"] = nn.Linear(width, hidden)
        layers[f"act{i}"] = _ACTIVATIONS[spec.activation]()
        if spec.dropout:
            layers[f"drop{i}"] = nn.Dropout(spec.dropout)
        width = hidden
    layers["out"] = nn.Linear(width, num_classes)
    return nn.Sequential(layers)


class CifarNet(nn.Module):
    """The classic small CIFAR-10 convnet (two 5x5 convs with max-pooling, three linear layers: 6-16-120-84),
    with the input channels and classes as arguments; parameter names match the usual `Net` of that shape."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)  # like view(-1, 400), but also valid for channels_last
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _cnn(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 3:
        raise JobError(f"cnn expects images of shape (C, H, W), got {input_shape}; use arch 'mlp'")
    channels, height, width = input_shape
    k = spec.kernel_size
    layers: list[nn.Module] = []
    for c in spec.channels or [32, 64]:
        # No conv bias before batch norm: its shift would be cancelled by the norm's mean.
        layers.append(nn.Conv2d(channels, c, k, padding=k // 2, bias=not spec.batch_norm))
        if spec.batch_norm:
            layers.append(nn.BatchNorm2d(c))
        layers.append(_ACTIVATIONS[spec.activation]())
        if height // 2 >= 2 and width // 2 >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        channels = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(spec.dropout), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


class ExpandChannels(nn.Module):
    """Repeats a 1-channel image to 3 channels so torchvision's RGB stems take MNIST-like data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def _torchvision(arch: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    import torchvision

    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise JobError(f"{arch} expects images of shape (1 or 3, H, W), got {input_shape}")
    kwargs: dict[str, Any] = {}
    if arch == "googlenet":
        kwargs = {"aux_logits": False, "init_weights": True}  # a plain logits tensor in train mode too
    elif arch.startswith("vit_"):
        size = input_shape[1]
        if input_shape[1] != input_shape[2] or size % 16:
            raise JobError(f"{arch} expects square images with a side divisible by 16, got {input_shape}")
        kwargs = {"image_size": size}
    # weights=None: random init, nothing is ever downloaded.
    net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    if input_shape[0] == 1:
        # Keys become "net.<...>"; build_model rebuilds the same wrapper when loading an artifact.
        return nn.Sequential(OrderedDict(expand=ExpandChannels(), net=net))
    return net
