"""Datasets -> in-memory tensors: the shipped CSVs, torchvision datasets, FakeData, and the train/val split.

Every dataset is decoded once into raw tensors (uint8 pixels, or the CSV's numbers), split, then
normalised by normalize(), which inference reuses on raw user inputs. The training loop slices
batches straight from these tensors, so they are kept contiguous and, when a device is given,
moved there once.
"""
import gzip
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from trainyard.app import plugins
from trainyard.app.errors import NotFound
from trainyard.app.layout import UPLOAD_DATA_FILE, UPLOAD_META_FILE, Layout, locked
from trainyard.app.spec import DATASET_INFO, UPLOAD_PREFIX, DataSpec, PredictData
from trainyard.worker import torch_devices
from trainyard.worker.context import JobError
from trainyard.worker.dataset_cache import cache_read, cache_write

SHIPPED = Path(__file__).parent / "datasets"
# Uploaded images are scaled like FakeData and CIFAR-10: to 0..1, then (x - 0.5) / 0.5.
UPLOAD_PIXEL_NORM = (0.5, 0.5)
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
    # uint8 images (raw inputs at inference are 0..255 too); an upload may hold uint8 features instead.
    pixels: bool | None = None

    def __post_init__(self) -> None:
        if self.pixels is None:
            self.pixels = self.x.dtype == torch.uint8


def normalize(dataset: str | None, x: Tensor, pixels: bool | None = None) -> Tensor:
    """Raw values in the dataset's original scale -> the float32 model inputs training used.

    iris: unchanged (raw features, in cm); digits: 0..16 -> 0..1; torchvision datasets and fake:
    0..255 -> /255, then (x - mean) / std with the dataset's pixel_norm (app/spec.py DATASET_INFO).
    Uploads and dataset plugins: images like fake, features as given; `pixels` says which
    (inference passes the artifact's, since JSON rows arrive as floats).
    """
    info = DATASET_INFO.get(dataset)
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
    raw = _load_raw(spec, data_dir)
    train_idx, val_idx = _split(raw, spec.val_fraction, spec.split_seed)
    place = _placement(raw, device)
    x_train, y_train = _take(spec.dataset, raw, train_idx, place)
    x_val, y_val = _take(spec.dataset, raw, val_idx, place)
    return TensorData(x_train, y_train, x_val, y_val, tuple(raw.x.shape[1:]), raw.class_names, pixels=raw.pixels)


def split_for_predict(data: PredictData, train_data_spec: DataSpec | None, data_dir: Path,
                      device: torch.device | None = None) -> tuple[Tensor, Tensor, list[str]]:
    """(x, y, class_names) of one split; val_fraction/split_seed default to the training job's,
    so {"split": "val"} is exactly the validation split that training reported on (a run job's
    model has no training data spec: the defaults apply)."""
    update = {"dataset": data.dataset}
    for field in ("val_fraction", "split_seed", "params"):
        if getattr(data, field) is not None:
            update[field] = getattr(data, field)
    # model_copy keeps the training job's fake-data shape and plugin params when the dataset is the same.
    base = train_data_spec if train_data_spec is not None else DataSpec(dataset=data.dataset)
    if base.dataset != data.dataset and data.params is None:
        update["params"] = None  # another plugin's parameters are not this dataset's
    spec = base.model_copy(update=update)
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
    return device if torch_devices.data_fits_device(nbytes, device) else torch.device("cpu")


def _take(dataset: str, raw: _Raw, idx: np.ndarray, device: torch.device) -> tuple[Tensor, Tensor]:
    idx_t = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
    # Move the compact raw values, then normalise on the device (uint8 is 4x smaller than float32).
    x = normalize(dataset, raw.x[idx_t].to(device), raw.pixels).contiguous()
    return x, raw.y[idx_t].to(device).contiguous()


# --- loaders: one per dataset name, each returning the whole dataset raw ---------------------------

def _load_raw(spec: DataSpec, data_dir: Path) -> _Raw:
    if spec.dataset.startswith(UPLOAD_PREFIX):
        return _upload(spec.dataset[len(UPLOAD_PREFIX):], data_dir)
    if spec.dataset not in _LOADERS:
        return _plugin(spec, data_dir)
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
    cache = Layout(data_dir).dataset_cache() / f"fake-{spec.size}-{c}x{h}x{w}-{spec.num_classes}-{spec.split_seed}.pt"
    names = [str(i) for i in range(spec.num_classes)]
    stored = cache_read(cache)
    if stored is not None:
        return _Raw(stored["x"], stored["y"], names)
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
    cache_write(cache, {"x": x, "y": y})
    return _Raw(x, y, names)


def _torchvision(class_name: str, class_names: list[str]) -> Callable[[DataSpec, Path], _Raw]:
    """A loader for mnist, fashion_mnist or cifar10: the official train split trains, the official test
    split validates (val_fraction and split_seed do not apply). Decoded once into a uint8 cache."""

    def load_it(spec: DataSpec, data_dir: Path) -> _Raw:
        layout = Layout(data_dir)
        cache, raw_dir = layout.dataset_cache() / f"{spec.dataset}.pt", layout.raw_datasets()
        with locked(layout.dataset_lock(spec.dataset)):  # workers on one host: one decodes, the others wait
            stored = cache_read(cache)
            if stored is None:
                import torchvision

                cls = getattr(torchvision.datasets, class_name)
                try:
                    parts = [_open_torchvision(cls, raw_dir, train) for train in (True, False)]
                except Exception as e:
                    raise JobError(
                        f"dataset {spec.dataset!r} is not available: its files are not in {raw_dir} and downloading "
                        f"them failed ({type(e).__name__}: {e}). Put the torchvision {class_name} files "
                        f"under {raw_dir / class_name} (or give the worker network access)") from e
                xs, ys = zip(*(_decode_torchvision(p) for p in parts))
                stored = {"x": torch.cat(xs), "y": torch.cat(ys), "n_train": len(ys[0])}
                cache_write(cache, stored)
        return _Raw(stored["x"], stored["y"], class_names, official_train=int(stored["n_train"]))

    return load_it


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
    """A dataset uploaded through POST /datasets, as app/uploads/ validated and stored it: float32 or
    uint8 features (used as given) or uint8 N x C x H x W pixels; int64 labels; class names from its meta."""
    try:
        folder = Layout(data_dir).upload(upload_id)
    except NotFound as e:
        raise JobError(str(e)) from None
    try:
        meta = json.loads((folder / UPLOAD_META_FILE).read_text())
        classes = [str(c) for c in meta["classes"]]
        with np.load(folder / UPLOAD_DATA_FILE, allow_pickle=False) as stored:
            x, y = stored["x"], stored["y"]
    except FileNotFoundError:
        raise JobError(f"dataset upload:{upload_id} not found in {folder.parent}; it may have been deleted") from None
    except (OSError, ValueError, KeyError) as e:
        raise JobError(f"dataset upload:{upload_id} in {folder} is damaged ({type(e).__name__}: {e})") from None
    if x.dtype not in (np.uint8, np.float32) or y.dtype != np.int64 or len(x) != len(y) or \
            (len(y) and not 0 <= y.min() <= y.max() < len(classes)):
        raise JobError(f"dataset upload:{upload_id} in {folder} is damaged (x {x.dtype} {x.shape}, "
                       f"y {y.dtype} {y.shape}, {len(classes)} classes)")
    # Uploads stored before meta.json said: uint8 was only ever kept for N x C x H x W images.
    pixels = meta.get("pixels", x.dtype == np.uint8 and x.ndim == 4)
    return _Raw(torch.from_numpy(x), torch.from_numpy(y), classes, pixels=pixels)


def _plugin(spec: DataSpec, data_dir: Path) -> _Raw:
    """A dataset plugin: loader(data_dir, **params) -> {"x", "y", "classes"[, "x_val", "y_val"]}."""
    try:
        loader = plugins.load("datasets", spec.dataset)
    except LookupError as e:
        raise JobError(str(e)) from None
    out = loader(data_dir, **(spec.params or {}))
    what = f"dataset plugin {spec.dataset!r}"
    if not isinstance(out, dict) or not {"x", "y", "classes"} <= set(out):
        raise JobError(f"{what} must return a dict with x, y and classes (and optionally x_val, y_val)")
    classes = [str(c) for c in out["classes"]]
    xs = [torch.as_tensor(out["x"])] + ([torch.as_tensor(out["x_val"])] if "x_val" in out else [])
    ys = [torch.as_tensor(out["y"])] + ([torch.as_tensor(out["y_val"])] if "y_val" in out else [])
    for x, y in zip(xs, ys):
        if x.dtype not in (torch.uint8, torch.float32) or y.dtype != torch.int64 or len(x) != len(y) or \
                x.ndim < 2 or (len(y) and not 0 <= int(y.min()) <= int(y.max()) < len(classes)):
            raise JobError(f"{what} returned x {x.dtype} {tuple(x.shape)} and y {y.dtype} {tuple(y.shape)} for "
                           f"{len(classes)} classes; x must be float32 or uint8 (samples first), y int64 class indices")
    if len({x.shape[1:] for x in xs}) != 1 or len({x.dtype for x in xs}) != 1:
        raise JobError(f"{what} returned x and x_val of different shapes or dtypes")
    official = len(ys[0]) if len(ys) == 2 else None  # its own validation split: the way official splits work
    return _Raw(torch.cat(xs).contiguous(), torch.cat(ys), classes, official_train=official)


# One loader per built-in dataset (app/spec.py DATASET_INFO lists them with their shapes and scaling).
_LOADERS: dict[str, Callable[[DataSpec, Path], _Raw]] = {
    "iris": _iris, "digits": _digits, "fake": _fake,
    "mnist": _torchvision("MNIST", [str(i) for i in range(10)]),
    "fashion_mnist": _torchvision("FashionMNIST", FASHION_MNIST_CLASSES),
    "cifar10": _torchvision("CIFAR10", CIFAR10_CLASSES),
}
