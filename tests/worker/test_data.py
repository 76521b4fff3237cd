"""worker/data.py: shipped datasets, the sklearn-compatible split, FakeData caching, torchvision datasets offline."""
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from sklearn.datasets import load_iris
from sklearn.model_selection import train_test_split

from trainyard.app.spec import DataSpec, PredictData
from trainyard.worker import data, data_sources
from trainyard.worker.errors import JobError


def test_iris_split_equals_sklearn_train_test_split(tmp_path):
    X, y = load_iris(return_X_y=True)
    X_train, X_val, y_train, y_val = train_test_split(X, y, test_size=0.2, random_state=33)
    d = data.load(DataSpec(dataset="iris", val_fraction=0.2, split_seed=33), tmp_path)
    # Raw features, as the seed tutorial trains on them: no normalisation.
    assert torch.equal(d.x_train, torch.tensor(X_train, dtype=torch.float32))
    assert torch.equal(d.x_val, torch.tensor(X_val, dtype=torch.float32))
    assert torch.equal(d.y_train, torch.tensor(y_train))
    assert torch.equal(d.y_val, torch.tensor(y_val))
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert d.input_shape == (4,)
    assert d.class_names == ["setosa", "versicolor", "virginica"]


@pytest.mark.parametrize("n, fraction, seed", [(1797, 0.25, 7), (10, 0.33, 0), (150, 0.5, 2**32 - 1), (7, 0.01, 5)])
def test_split_indices_equal_sklearn(n, fraction, seed):
    idx = np.arange(n)
    want_train, want_val = train_test_split(idx, test_size=fraction, random_state=seed)
    train, val = data.split_indices(n, fraction, seed)
    np.testing.assert_array_equal(train, want_train)
    np.testing.assert_array_equal(val, want_val)


def test_digits_shapes_and_scale(tmp_path):
    d = data.load(DataSpec(dataset="digits", val_fraction=0.2, split_seed=1), tmp_path)
    assert d.input_shape == (1, 8, 8)
    assert d.x_train.shape == (1437, 1, 8, 8) and d.x_val.shape == (360, 1, 8, 8)
    assert d.x_train.is_contiguous()
    everything = torch.cat([d.x_train, d.x_val])
    assert everything.min() == 0.0 and everything.max() == 1.0  # pixels 0..16 scaled by 1/16
    assert torch.equal(everything * 16, (everything * 16).round())
    assert d.class_names == [str(i) for i in range(10)]
    assert sorted(torch.cat([d.y_train, d.y_val]).unique().tolist()) == list(range(10))


def test_normalize_matches_torchvision_transforms():
    pixels = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    from torchvision.transforms import Normalize
    want = Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))(pixels.float() / 255)
    assert torch.equal(data.normalize("cifar10", pixels), want)
    mnist = torch.tensor([[[[0, 255]]]], dtype=torch.uint8)
    want_mnist = torch.tensor([-0.1307 / 0.3081, 0.8693 / 0.3081]).view(1, 1, 1, 2)
    assert torch.allclose(data.normalize("mnist", mnist), want_mnist)
    assert torch.equal(data.normalize("iris", torch.tensor([[5.1, 3.5]])), torch.tensor([[5.1, 3.5]]))
    assert torch.equal(data.normalize("digits", torch.tensor([16.0, 8.0])), torch.tensor([1.0, 0.5]))


def _fake_spec(**kw):
    return DataSpec(dataset="fake", size=40, image_size=[2, 8, 8], num_classes=3, val_fraction=0.25, **kw)


def test_fake_dataset_shape_and_cache(tmp_path, monkeypatch):
    d = data.load(_fake_spec(split_seed=4), tmp_path)
    assert d.input_shape == (2, 8, 8)
    assert d.x_train.shape == (30, 2, 8, 8) and d.x_val.shape == (10, 2, 8, 8)
    assert d.class_names == ["0", "1", "2"]
    assert d.x_train.min() >= -1.0 and d.x_train.max() <= 1.0
    assert set(torch.cat([d.y_train, d.y_val]).tolist()) <= {0, 1, 2}
    assert [p.name for p in (tmp_path / "datasets" / "cache").iterdir()] == ["fake-40-2x8x8-3-4.pt"]

    # The second load must come from the cache, not from FakeData.
    def no_fakedata(*a, **kw):
        raise AssertionError("FakeData decoded again despite the cache")
    monkeypatch.setattr(torchvision.datasets, "FakeData", no_fakedata)
    again = data.load(_fake_spec(split_seed=4), tmp_path)
    assert torch.equal(again.x_train, d.x_train) and torch.equal(again.y_val, d.y_val)


def test_fake_dataset_depends_on_split_seed_and_leaves_rng_alone(tmp_path):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = data.load(_fake_spec(split_seed=1), tmp_path)
    assert torch.equal(torch.get_rng_state(), before)
    b = data.load(_fake_spec(split_seed=2), tmp_path)
    assert not torch.equal(a.x_train, b.x_train)


def _write_idx(path: Path, array: np.ndarray) -> None:
    # The MNIST IDX format: magic (0, 0, dtype 0x08 = uint8, ndim), big-endian dims, raw bytes.
    header = struct.pack(">I", 0x0800 + array.ndim) + b"".join(struct.pack(">I", s) for s in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_torchvision_dataset_decoded_once_into_cache(tmp_path, monkeypatch):
    raw = tmp_path / "datasets" / "raw" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train_x, test_x = rng.integers(0, 256, (6, 28, 28)), rng.integers(0, 256, (4, 28, 28))
    _write_idx(raw / "train-images-idx3-ubyte", train_x)
    _write_idx(raw / "train-labels-idx1-ubyte", np.arange(6) % 10)
    _write_idx(raw / "t10k-images-idx3-ubyte", test_x)
    _write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(4) + 5)
    monkeypatch.setattr(torchvision.datasets.MNIST, "download", _no_network)

    spec = DataSpec(dataset="mnist", val_fraction=0.5, split_seed=9)  # both ignored: official split
    d = data.load(spec, tmp_path)
    assert d.input_shape == (1, 28, 28) and d.class_names == [str(i) for i in range(10)]
    assert d.x_train.shape == (6, 1, 28, 28) and d.x_val.shape == (4, 1, 28, 28)
    assert torch.equal(d.y_val, torch.tensor([5, 6, 7, 8]))
    want = (torch.tensor(train_x, dtype=torch.float32).unsqueeze(1) / 255 - 0.1307) / 0.3081
    assert torch.equal(d.x_train, want)
    assert (tmp_path / "datasets" / "cache" / "mnist.pt").exists()

    # With the raw files gone, the cache alone serves the dataset.
    for f in raw.iterdir():
        f.unlink()
    assert torch.equal(data.load(spec, tmp_path).x_val, d.x_val)


def _no_network(self):
    raise RuntimeError("Error downloading train-images-idx3-ubyte.gz: [Errno -3] no network")


@pytest.mark.parametrize("name, cls", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST"), ("cifar10", "CIFAR10")])
def test_missing_torchvision_dataset_is_a_job_error(tmp_path, monkeypatch, name, cls):
    monkeypatch.setattr(getattr(torchvision.datasets, cls), "download", _no_network)
    with pytest.raises(JobError) as err:
        data.load(DataSpec(dataset=name), tmp_path)
    message = str(err.value)
    assert repr(name) in message
    assert str(tmp_path / "datasets" / "raw") in message
    assert not (tmp_path / "datasets" / "cache" / f"{name}.pt").exists()


def test_split_for_predict_reuses_the_training_split(tmp_path):
    train_spec = DataSpec(dataset="iris", val_fraction=0.3, split_seed=5)
    d = data.load(train_spec, tmp_path)
    x, y, names = data.split_for_predict(PredictData(dataset="iris", split="val"), train_spec, tmp_path)
    assert torch.equal(x, d.x_val) and torch.equal(y, d.y_val) and names == d.class_names
    x, y, _ = data.split_for_predict(PredictData(dataset="iris", split="train"), train_spec, tmp_path)
    assert torch.equal(x, d.x_train)
    x, y, _ = data.split_for_predict(PredictData(dataset="iris", split="all"), train_spec, tmp_path)
    assert len(y) == 150 and torch.equal(y, torch.tensor(load_iris().target))
    x, y, _ = data.split_for_predict(PredictData(dataset="iris", split="val", val_fraction=0.1), train_spec, tmp_path)
    assert len(y) == 15


def test_split_for_predict_keeps_the_training_fake_shape(tmp_path):
    train_spec = _fake_spec(split_seed=3)
    d = data.load(train_spec, tmp_path)
    x, y, _ = data.split_for_predict(PredictData(dataset="fake"), train_spec, tmp_path)
    assert torch.equal(x, d.x_val) and torch.equal(y, d.y_val)


def test_missing_upload_is_a_clear_job_error(tmp_path):
    with pytest.raises(JobError, match=r"dataset upload:abc123 not found in .*; it may have been deleted"):
        data.load(DataSpec(dataset="upload:abc123"), tmp_path)


def test_uploaded_pixels_are_scaled_features_are_not():
    pixels = torch.tensor([0, 255], dtype=torch.uint8).reshape(1, 1, 1, 2)  # N x C x H x W images
    assert data.normalize("upload:x", pixels).flatten().tolist() == [-1.0, 1.0]
    # uint8 feature columns (an npz upload keeps uint8 as stored) are used as given.
    assert data.normalize("upload:x", torch.tensor([[0, 255]], dtype=torch.uint8)).tolist() == [[0.0, 255.0]]
    assert data.normalize("upload:x", torch.tensor([[0.0, 255.0]]), pixels=True).tolist() == [[-1.0, 1.0]]
    assert data.normalize("upload:x", torch.tensor([[0.5, 7.0]])).tolist() == [[0.5, 7.0]]


def test_digits_csv_is_the_sklearn_digits_data():
    from sklearn.datasets import load_digits
    with gzip.open(data_sources.SHIPPED / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    X, y = load_digits(return_X_y=True)
    np.testing.assert_array_equal(table[:, :-1], X)
    np.testing.assert_array_equal(table[:, -1], y)
