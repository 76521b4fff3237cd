""".npz uploads: arrays x (samples x features, or uint8 N x C x H x W images) and y (labels).

An .npz is a zip of .npy files. Each array's header (dtype and shape) is read before the array
itself, so its decoded size is known and bounded before a byte of it is inflated; object arrays,
which would need unpickling, are refused from the header. uint8 arrays stay uint8 (4x smaller
than float32); everything else becomes float32, as the model will use it.
"""
import math
import zipfile
from typing import BinaryIO

import numpy as np
from numpy.lib import format as npy

from trainyard.app.uploads.limits import Limits, check_decoded, index_labels, refuse
from trainyard.app.uploads.zip_format import open_zip


def parse_npz(f: BinaryIO, limits: Limits, upload_bytes: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    zf = open_zip(f, "a .npz", limits, upload_bytes)
    members = {info.filename.removesuffix(".npy"): info for info in zf.infolist()}
    missing = [k for k in ("x", "y") if k not in members]
    if missing:
        raise refuse("file", f"must hold arrays 'x' and 'y' (np.savez(path, x=x, y=y)); missing "
                             f"{' and '.join(map(repr, missing))}; it has: {', '.join(sorted(members)) or 'none'}")
    headers = {k: _header(zf, members[k], k) for k in ("x", "y")}
    # What decoding costs: both arrays as stored, plus x again as float32 unless it stays uint8.
    (x_shape, x_dtype), (y_shape, y_dtype) = headers["x"], headers["y"]
    cost = sum(math.prod(s) * d.itemsize for s, d in headers.values())
    if x_dtype != np.uint8:
        cost += math.prod(x_shape) * 4
    check_decoded(cost, upload_bytes, limits, f"x {x_shape} {x_dtype} and y {y_shape} {y_dtype}")
    x, y = (_array(zf, members[k], k) for k in ("x", "y"))
    return _check(x, y, limits)


def _header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        with zf.open(info) as member:
            version = npy.read_magic(member)
            read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, _fortran, dtype = read(member)
    except Exception as e:
        raise refuse("file", f"array {key!r} is not readable ({type(e).__name__}: {e})") from None
    if dtype.hasobject:
        raise refuse("file", f"array {key!r} holds Python objects, which would need unpickling; only numeric "
                             "arrays (and strings for y) are accepted")
    return shape, dtype


def _array(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> np.ndarray:
    try:
        with zf.open(info) as member:
            return npy.read_array(member, allow_pickle=False)
    except Exception as e:
        raise refuse("file", f"array {key!r} is not readable ({type(e).__name__}: {e})") from None


def _check(x: np.ndarray, y: np.ndarray, limits: Limits) -> tuple[np.ndarray, np.ndarray, list[str]]:
    if x.dtype.kind not in "biuf":
        raise refuse("file", f"x must be numeric; it has dtype {x.dtype}")
    if not 2 <= x.ndim <= 4 or 0 in x.shape[1:]:
        raise refuse("file", f"x must have shape (samples, features...) with 2 to 4 dimensions; got {x.shape} "
                             "(one feature per sample: x.reshape(-1, 1))")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise refuse("file", f"y must be one label per sample, shape (samples,); got {y.shape}")
    if len(x) != len(y):
        raise refuse("file", f"x has {len(x)} samples but y has {len(y)}")
    if x.dtype != np.uint8:
        with np.errstate(over="ignore", invalid="ignore"):
            x = x.astype(np.float32)
        bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        if bad.any():
            raise refuse("file", f"x has NaN or infinite values (or values too large for float32), first in sample "
                                 f"{int(np.argmax(bad))}")
    return np.ascontiguousarray(x), *_labels(y, limits)


def _labels(y: np.ndarray, limits: Limits) -> tuple[np.ndarray, list[str]]:
    if y.dtype.kind == "f":
        if not np.isfinite(y).all() or (y != np.round(y)).any():
            raise refuse("file", "y must hold class labels: integers or strings; it has non-integer floats")
        y = y.astype(np.int64)
    elif y.dtype.kind == "b":
        y = y.astype(np.int64)
    elif y.dtype.kind not in "iuUS":
        raise refuse("file", f"y must hold class labels: integers or strings; it has dtype {y.dtype}")
    return index_labels(y.astype(str) if y.dtype.kind == "S" else y, limits)
