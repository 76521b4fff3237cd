"""A model plugin: factory(input_shape, num_classes, **params) -> torch.nn.Module."""
import math

from torch import nn


def tinynet(input_shape: tuple[int, ...], num_classes: int, width: int = 32, depth: int = 1) -> nn.Module:
    """Images (C, H, W): a small convnet; anything else: an MLP of `depth` hidden layers of `width`."""
    if len(input_shape) == 3:
        c = input_shape[0]
        return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                             nn.Linear(width * 16, num_classes))
    layers: list[nn.Module] = [nn.Flatten()]
    size = math.prod(input_shape)
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, num_classes))
