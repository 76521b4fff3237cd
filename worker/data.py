"""Datasets -> in-memory tensors: the train/val split and normalisation of what worker/data_sources.py loads.

Every dataset is decoded once into raw tensors (uint8 pixels, or the CSV's numbers), split, then
normalised by normalize(), which inference reuses on raw user inputs. The training loop slices
batches straight from these tensors, so they are kept contiguous and, when a device is given,
moved there once.
"""
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trainyard.app.spec import DATASET_INFO, DataSpec, PredictData
from trainyard.worker import torch_devices
from trainyard.worker.data_sources import Raw, load_raw
from trainyard.worker.errors import JobError

# Uploaded images are scaled like FakeData and CIFAR-10: to 0..1, then (x - 0.5) / 0.5.
UPLOAD_PIXEL_NORM = (0.5, 0.5)


@dataclass
class TensorData:
    x_train: Tensor  # float32, normalised
    y_train: Tensor  # int64
    x_val: Tensor
    y_val: Tensor
    input_shape: tuple[int, ...]  # per sample: (4,) iris, (1, 8, 8) digits, (3, 32, 32) cifar10
    class_names: list[str]
    pixels: bool = False  # the raw values were uint8 pixels (so raw inputs at inference are 0..255)


def normalize(dataset: str | None, x: Tensor, pixels: bool | None = None) -> Tensor:
    """Raw values in the dataset's original scale -> the float32 model inputs training used.

    iris: unchanged (raw features, in cm); digits: 0..16 -> 0..1; torchvision datasets and fake:
    0..255 -> /255, then (x - mean) / std with the dataset's pixel_norm (app/spec/common.py DATASET_INFO).
    Uploads and dataset plugins: images like fake, features as given; `pixels` says which
    (inference passes the artifact's, since JSON rows arrive as floats).
    """
    info = DATASET_INFO.get(dataset) if dataset is not None else None
    if info is None:  # an upload, a dataset plugin's, or unnamed (a run job's model)
        norm = UPLOAD_PIXEL_NORM if (x.dtype == torch.uint8 and x.ndim == 4 if pixels is None else pixels) else None
    else:
        norm = info.get("pixel_norm")
    x = x.float()
    if dataset == "digits":
        return x / 16.0
    if norm is not None:
        mean, std = norm
        return (x / 255.0 - mean) / std
    return x


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices exactly as sklearn's train_test_split(test_size=val_fraction, random_state=seed)."""
    n_val = math.ceil(val_fraction * n)
    n_train = n - n_val
    if n_train < 1 or n_val < 1:
        raise JobError(f"val_fraction {val_fraction} leaves an empty split of {n} samples")
    perm = np.random.RandomState(seed).permutation(n)
    return perm[n_val:n_val + n_train], perm[:n_val]


def load(spec: DataSpec, data_dir: Path, device: torch.device | None = None) -> TensorData:
    """The dataset as normalised train/val tensors, on device if given (and it fits).

    mnist, fashion_mnist and cifar10 use their official splits (test = val): val_fraction and
    split_seed only apply to the other datasets.
    """
    raw = load_raw(spec, data_dir)
    train_idx, val_idx = _split(raw, spec.val_fraction, spec.split_seed)
    place = _placement(raw, device)
    x_train, y_train = _take(spec.dataset, raw, train_idx, place)
    x_val, y_val = _take(spec.dataset, raw, val_idx, place)
    return TensorData(x_train, y_train, x_val, y_val, tuple(raw.x.shape[1:]), raw.class_names, pixels=bool(raw.pixels))


def split_for_predict(data: PredictData, train_data_spec: DataSpec | None, data_dir: Path,
                      device: torch.device | None = None) -> tuple[Tensor, Tensor, list[str]]:
    """(x, y, class_names) of one split; val_fraction/split_seed default to the training job's,
    so {"split": "val"} is exactly the validation split that training reported on (a run job's
    model has no training data spec: the defaults apply)."""
    update: dict[str, Any] = {"dataset": data.dataset}
    for field in ("val_fraction", "split_seed", "params"):
        if getattr(data, field) is not None:
            update[field] = getattr(data, field)
    # model_copy keeps the training job's fake-data shape and plugin params when the dataset is the same.
    base = train_data_spec if train_data_spec is not None else DataSpec(dataset=data.dataset, params=None)
    if base.dataset != data.dataset and data.params is None:
        update["params"] = None  # another plugin's parameters are not this dataset's
    spec = base.model_copy(update=update)
    raw = load_raw(spec, data_dir)
    train_idx, val_idx = _split(raw, spec.val_fraction, spec.split_seed)
    idx = {"train": train_idx, "val": val_idx, "all": np.arange(len(raw.y))}[data.split]
    x, y = _take(spec.dataset, raw, idx, _placement(raw, device))
    return x, y, raw.class_names


def _split(raw: Raw, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if raw.official_train is not None:
        return np.arange(raw.official_train), np.arange(raw.official_train, len(raw.y))
    return split_indices(len(raw.y), val_fraction, seed)


def _placement(raw: Raw, device: torch.device | None) -> torch.device:
    # Whole dataset on the GPU when it fits: batches are then index slices with no host copies.
    if device is None:
        return torch.device("cpu")
    nbytes = raw.x.numel() * 4 + raw.y.numel() * 8  # as float32 / int64
    return device if torch_devices.data_fits_device(nbytes, device) else torch.device("cpu")


def _take(dataset: str, raw: Raw, idx: np.ndarray, device: torch.device) -> tuple[Tensor, Tensor]:
    idx_t = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
    # Move the compact raw values, then normalise on the device (uint8 is 4x smaller than float32).
    x = normalize(dataset, raw.x[idx_t].to(device), raw.pixels).contiguous()
    return x, raw.y[idx_t].to(device).contiguous()
