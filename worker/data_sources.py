"""Datasets by name -> whole raw tensors (Raw): the shipped CSVs (iris, digits), torchvision FakeData,
MNIST, Fashion-MNIST and CIFAR-10 (decoded once into a cache), uploads, and dataset plugins.
worker/data.py splits and normalises what these return."""
import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from trainyard.app.core import plugins
from trainyard.app.core.errors import NotFound
from trainyard.app.core.layout import UPLOAD_DATA_FILE, UPLOAD_META_FILE, Layout, locked
from trainyard.app.spec import UPLOAD_PREFIX, DataSpec
from trainyard.worker.dataset_cache import cache_read, cache_write
from trainyard.worker.errors import JobError

SHIPPED = Path(__file__).parent / "datasets"
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot"]


@dataclass
class Raw:
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


def load_raw(spec: DataSpec, data_dir: Path) -> Raw:
    if spec.dataset.startswith(UPLOAD_PREFIX):
        return _upload(spec.dataset[len(UPLOAD_PREFIX):], data_dir)
    if spec.dataset not in LOADERS:
        return _plugin(spec, data_dir)
    return LOADERS[spec.dataset](spec, data_dir)


def _iris(spec: DataSpec, data_dir: Path) -> Raw:
    # sklearn's CSV format: a header "n_samples,n_features,class names...", then features + label.
    path = SHIPPED / "iris.csv"
    header = path.read_text().splitlines()[0].split(",")
    table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
    x = torch.from_numpy(table[:, :-1].astype(np.float32))
    y = torch.from_numpy(table[:, -1].astype(np.int64))
    return Raw(x, y, header[2:])


def _digits(spec: DataSpec, data_dir: Path) -> Raw:
    with gzip.open(SHIPPED / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    x = torch.from_numpy(table[:, :-1].astype(np.uint8)).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(table[:, -1])
    return Raw(x, y, [str(i) for i in range(10)])


def _fake(spec: DataSpec, data_dir: Path) -> Raw:
    """torchvision FakeData decoded to uint8; split_seed picks which images (disjoint per seed)."""
    c, h, w = spec.image_size
    cache = Layout(data_dir).dataset_cache() / f"fake-{spec.size}-{c}x{h}x{w}-{spec.num_classes}-{spec.split_seed}.pt"
    names = [str(i) for i in range(spec.num_classes)]
    stored = cache_read(cache)
    if stored is not None:
        return Raw(stored["x"], stored["y"], names)
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
    return Raw(x, y, names)


def _torchvision(class_name: str, class_names: list[str]) -> Callable[[DataSpec, Path], Raw]:
    """A loader for mnist, fashion_mnist or cifar10: the official train split trains, the official test
    split validates (val_fraction and split_seed do not apply). Decoded once into a uint8 cache."""

    def load_it(spec: DataSpec, data_dir: Path) -> Raw:
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
        return Raw(stored["x"], stored["y"], class_names, official_train=int(stored["n_train"]))

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


def _upload(upload_id: str, data_dir: Path) -> Raw:
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
    return Raw(torch.from_numpy(x), torch.from_numpy(y), classes, pixels=pixels)


def _plugin(spec: DataSpec, data_dir: Path) -> Raw:
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
    return Raw(torch.cat(xs).contiguous(), torch.cat(ys), classes, official_train=official)


# One loader per built-in dataset (app/spec/common.py DATASET_INFO lists them with their shapes and scaling).
LOADERS: dict[str, Callable[[DataSpec, Path], Raw]] = {
    "iris": _iris, "digits": _digits, "fake": _fake,
    "mnist": _torchvision("MNIST", [str(i) for i in range(10)]),
    "fashion_mnist": _torchvision("FashionMNIST", FASHION_MNIST_CLASSES),
    "cifar10": _torchvision("CIFAR10", CIFAR10_CLASSES),
}
