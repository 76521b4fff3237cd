"""Datasets -> in-memory tensors: the shipped CSVs, torchvision datasets, FakeData, and the train/val split.

Every dataset is decoded once into raw tensors (uint8 pixels, or the CSV's numbers), split, then
normalised by normalize(), which inference reuses on raw user inputs. The training loop slices
batches straight from these tensors, so they are kept contiguous and, when a device is given,
moved there once.
"""
import fcntl
import gzip
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from app.spec import UPLOAD_PREFIX, DataSpec, PredictData
from worker import devices
from worker.artifacts import atomic_torch_save
from worker.context import JobError

SHIPPED = Path(__file__).parent / "datasets"

# (mean, std) applied to pixels scaled to 0..1, as transforms.Normalize does (the same for every channel).
_PIXEL_NORMS = {
    "mnist": (0.1307, 0.3081),
    "fashion_mnist": (0.2860, 0.3530),
    "cifar10": (0.5, 0.5),  # seed 002's transform: Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    "fake": (0.5, 0.5),
}
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot"]


@dataclass
class TensorData:
    x_train: Tensor  # float32, normalised
    y_train: Tensor  # int64
    x_val: Tensor
    y_val: Tensor
    input_shape: tuple[int, ...]  # per sample: (4,) iris, (1, 8, 8) digits, (3, 32, 32) cifar10
    class_names: list[str]
    pixels: bool = False  # the raw values were uint8 pixels (so raw inputs at inference are 0..255)


@dataclass
class _Raw:
    """A whole dataset before splitting and normalisation."""
    x: Tensor  # raw scale: the CSV's floats, or uint8 pixels
    y: Tensor  # int64
    class_names: list[str]
    # Datasets with an official test split store train then test; this is the train count.
    # None: split by val_fraction / split_seed.
    official_train: int | None = None


def normalize(dataset: str, x: Tensor, pixels: bool | None = None) -> Tensor:
    """Raw values in the dataset's original scale -> the float32 model inputs training used.

    iris: unchanged (the tutorial trains on raw features); digits: 0..16 -> 0..1;
    torchvision datasets and fake: 0..255 -> /255, then (x - mean) / std.
    """
    if dataset.startswith(UPLOAD_PREFIX):
        # Uploaded images are uint8 pixels, scaled like fake/cifar10; features are used as given.
        # Inference passes `pixels` from the artifact, since JSON rows arrive as floats.
        pixels = x.dtype == torch.uint8 if pixels is None else pixels
        return (x.float() / 255.0 - 0.5) / 0.5 if pixels else x.float()
    x = x.float()
    if dataset == "digits":
        return x / 16.0
    if dataset in _PIXEL_NORMS:
        mean, std = _PIXEL_NORMS[dataset]
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
    raw = _load_raw(spec, data_dir)
    train_idx, val_idx = _split(raw, spec.val_fraction, spec.split_seed)
    place = _placement(raw, device)
    x_train, y_train = _take(spec.dataset, raw, train_idx, place)
    x_val, y_val = _take(spec.dataset, raw, val_idx, place)
    return TensorData(x_train, y_train, x_val, y_val, tuple(raw.x.shape[1:]), raw.class_names,
                      pixels=raw.x.dtype == torch.uint8)


def split_for_predict(data: PredictData, train_data_spec: DataSpec, data_dir: Path,
                      device: torch.device | None = None) -> tuple[Tensor, Tensor, list[str]]:
    """(x, y, class_names) of one split; val_fraction/split_seed default to the training job's,
    so {"split": "val"} is exactly the validation split that training reported on."""
    update = {"dataset": data.dataset}
    if data.val_fraction is not None:
        update["val_fraction"] = data.val_fraction
    if data.split_seed is not None:
        update["split_seed"] = data.split_seed
    # model_copy keeps the training job's fake-data shape when the dataset is the same.
    spec = train_data_spec.model_copy(update=update)
    raw = _load_raw(spec, data_dir)
    train_idx, val_idx = _split(raw, spec.val_fraction, spec.split_seed)
    idx = {"train": train_idx, "val": val_idx, "all": np.arange(len(raw.y))}[data.split]
    x, y = _take(spec.dataset, raw, idx, _placement(raw, device))
    return x, y, raw.class_names


def _split(raw: _Raw, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if raw.official_train is not None:
        return np.arange(raw.official_train), np.arange(raw.official_train, len(raw.y))
    return split_indices(len(raw.y), val_fraction, seed)


def _placement(raw: _Raw, device: torch.device | None) -> torch.device:
    # Whole dataset on the GPU when it fits: batches are then index slices with no host copies.
    if device is None:
        return torch.device("cpu")
    nbytes = raw.x.numel() * 4 + raw.y.numel() * 8  # as float32 / int64
    return device if devices.fits_on_device(nbytes, device) else torch.device("cpu")


def _take(dataset: str, raw: _Raw, idx: np.ndarray, device: torch.device) -> tuple[Tensor, Tensor]:
    idx_t = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
    # Move the compact raw values, then normalise on the device (uint8 is 4x smaller than float32).
    x = normalize(dataset, raw.x[idx_t].to(device)).contiguous()
    return x, raw.y[idx_t].to(device).contiguous()


# --- loaders: one per dataset name, each returning the whole dataset raw ---------------------------

def _load_raw(spec: DataSpec, data_dir: Path) -> _Raw:
    if spec.dataset.startswith(UPLOAD_PREFIX):
        return _upload(spec.dataset[len(UPLOAD_PREFIX):], data_dir)
    if spec.dataset in _TORCHVISION:
        return _torchvision(spec.dataset, data_dir)
    return _LOADERS[spec.dataset](spec, data_dir)


def _iris(spec: DataSpec, data_dir: Path) -> _Raw:
    # sklearn's CSV format: a header "n_samples,n_features,class names...", then features + label.
    path = SHIPPED / "iris.csv"
    header = path.read_text().splitlines()[0].split(",")
    table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
    x = torch.from_numpy(table[:, :-1].astype(np.float32))
    y = torch.from_numpy(table[:, -1].astype(np.int64))
    return _Raw(x, y, header[2:])


def _digits(spec: DataSpec, data_dir: Path) -> _Raw:
    with gzip.open(SHIPPED / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    x = torch.from_numpy(table[:, :-1].astype(np.uint8)).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, -1])
    return _Raw(x, y, [str(i) for i in range(10)])


def _fake(spec: DataSpec, data_dir: Path) -> _Raw:
    """torchvision FakeData decoded to uint8; split_seed picks which images (disjoint per seed)."""
    c, h, w = spec.image_size
    cache = _cache_dir(data_dir) / f"fake-{spec.size}-{c}x{h}x{w}-{spec.num_classes}-{spec.split_seed}.pt"
    if cache.exists():
        stored = torch.load(cache, map_location="cpu", weights_only=True)
        return _Raw(stored["x"], stored["y"], [str(i) for i in range(spec.num_classes)])
    import torchvision
    from torchvision.transforms import PILToTensor

    ds = torchvision.datasets.FakeData(
        size=spec.size, image_size=(c, h, w), num_classes=spec.num_classes, transform=PILToTensor(),
        random_offset=spec.split_seed * spec.size)
    x = torch.empty((spec.size, c, h, w), dtype=torch.uint8)
    y = torch.empty(spec.size, dtype=torch.int64)
    # FakeData re-seeds the global RNG per image and restores only the CPU state, so fork it.
    with torch.random.fork_rng(devices=[]):
        for i in range(spec.size):
            img, label = ds[i]
            x[i] = img.reshape(c, h, w)
            y[i] = label
    atomic_torch_save(cache, {"x": x, "y": y})
    return _Raw(x, y, [str(i) for i in range(spec.num_classes)])


# torchvision class, class names. Official train split -> train, official test split -> val.
_TORCHVISION: dict[str, tuple[str, list[str]]] = {
    "mnist": ("MNIST", [str(i) for i in range(10)]),
    "fashion_mnist": ("FashionMNIST", FASHION_MNIST_CLASSES),
    "cifar10": ("CIFAR10", CIFAR10_CLASSES),
}


def _torchvision(name: str, data_dir: Path) -> _Raw:
    """mnist, fashion_mnist, cifar10: the official train split trains, the official test split
    validates (val_fraction and split_seed do not apply). Decoded once into a uint8 cache."""
    class_name, class_names = _TORCHVISION[name]
    cache = _cache_dir(data_dir) / f"{name}.pt"
    raw_dir = data_dir / "datasets" / "raw"
    with _lock(data_dir / "datasets" / f".{name}.lock"):
        if not cache.exists():
            import torchvision

            cls = getattr(torchvision.datasets, class_name)
            try:
                parts = [_open_torchvision(cls, raw_dir, train) for train in (True, False)]
            except Exception as e:  # noqa: BLE001 - URLError, RuntimeError, md5 mismatches...
                raise JobError(
                    f"dataset {name!r} is not available: its files are not in {raw_dir} and downloading "
                    f"them failed ({type(e).__name__}: {e}). Put the torchvision {class_name} files "
                    f"under {raw_dir / class_name} (or give the worker network access)") from e
            xs, ys = zip(*(_decode_torchvision(p) for p in parts))
            atomic_torch_save(cache, {"x": torch.cat(xs), "y": torch.cat(ys), "n_train": len(ys[0])})
    stored = torch.load(cache, map_location="cpu", weights_only=True)
    return _Raw(stored["x"], stored["y"], class_names, official_train=int(stored["n_train"]))


def _open_torchvision(cls, raw_dir: Path, train: bool):
    try:  # files already there: no network at all
        return cls(root=str(raw_dir), train=train, download=False)
    except RuntimeError:
        return cls(root=str(raw_dir), train=train, download=True)


def _decode_torchvision(ds) -> tuple[Tensor, Tensor]:
    data = ds.data
    if isinstance(data, np.ndarray):  # CIFAR: N, H, W, C uint8
        x = torch.from_numpy(data).permute(0, 3, 1, 2)
    else:  # MNIST family: N, H, W uint8 tensor
        x = data.unsqueeze(1)
    return x.contiguous(), torch.as_tensor(ds.targets, dtype=torch.int64)


def _upload(upload_id: str, data_dir: Path) -> _Raw:
    """A dataset uploaded through POST /datasets, as app/uploads.py validated and stored it: float32
    features (used as given) or uint8 N x C x H x W pixels; int64 labels; class names from its meta."""
    import json

    from app import uploads

    try:
        folder = uploads.upload_dir(data_dir, upload_id)
    except uploads.NotFound as e:
        raise JobError(str(e)) from None
    try:
        classes = [str(c) for c in json.loads((folder / uploads.META_FILE).read_text())["classes"]]
        with np.load(folder / uploads.DATA_FILE, allow_pickle=False) as stored:
            x, y = stored["x"], stored["y"]
    except FileNotFoundError:
        raise JobError(f"dataset upload:{upload_id} not found in {folder.parent}; it may have been deleted") from None
    except (OSError, ValueError, KeyError) as e:
        raise JobError(f"dataset upload:{upload_id} in {folder} is damaged ({type(e).__name__}: {e})") from None
    if x.dtype not in (np.uint8, np.float32) or y.dtype != np.int64 or len(x) != len(y) or \
            (len(y) and not 0 <= y.min() <= y.max() < len(classes)):
        raise JobError(f"dataset upload:{upload_id} in {folder} is damaged (x {x.dtype} {x.shape}, "
                       f"y {y.dtype} {y.shape}, {len(classes)} classes)")
    return _Raw(torch.from_numpy(x), torch.from_numpy(y), classes)


_LOADERS: dict[str, Callable[[DataSpec, Path], _Raw]] = {"iris": _iris, "digits": _digits, "fake": _fake}


def _cache_dir(data_dir: Path) -> Path:
    path = data_dir / "datasets" / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    # Workers on one host share data_dir: only one of them downloads and decodes a dataset.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
