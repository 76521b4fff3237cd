"""A dataset plugin: loader(data_dir, **params) -> {"x", "y", "classes"[, "x_val", "y_val"]}."""
from pathlib import Path

import torch


def blobs(data_dir: Path, n: int = 300, features: int = 5, classes: int = 3, spread: float = 1.0,
          seed: int = 0) -> dict:
    """Gaussian blobs: `classes` clusters of points in `features` dimensions, centres 4 apart."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    centres = torch.arange(classes, dtype=torch.float32)[:, None] * 4.0 * torch.ones(1, features)
    x = centres[y] + spread * torch.randn(n, features, generator=g)
    return {"x": x, "y": y.long(), "classes": [f"blob{i}" for i in range(classes)]}
