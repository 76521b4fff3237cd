"""Uploaded datasets: validate a CSV, .npz or ImageFolder zip and store it, normalised, under the data dir.

Each upload becomes <data_dir>/datasets/uploads/<id>/ with data.npz (x: float32 features or uint8
N x C x H x W pixels; y: int64 class indices 0..k-1) and meta.json. The id is made here; the
client's filename is kept only as a display name, never as a path. Untrusted input is parsed
without unpickling (np.load(allow_pickle=False)), zips are read in memory (nothing is extracted)
after checking every member name, and sizes, file counts and pixels are bounded up front.
Imports neither torch nor FastAPI: the worker reads the same layout through upload_dir().
"""
import csv
import io
import json
import math
import os
import re
import secrets
import shutil
import time
import zipfile
from array import array
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image

# Limits. MAX_UPLOAD_BYTES and MAX_ARCHIVE_FILES can be set from the environment.
MAX_UPLOAD_BYTES = int(os.environ.get("TRAINYARD_MAX_UPLOAD_BYTES", 200 << 20))
MAX_ARCHIVE_FILES = int(os.environ.get("TRAINYARD_MAX_UPLOAD_FILES", 100_000))
FORM_OVERHEAD_BYTES = 64 << 10  # multipart boundaries, part headers and the label_column field
MAX_UNCOMPRESSED_BYTES = 1 << 30  # sum of a zip's (or .npz's) members once inflated: zip bombs
MAX_DECODED_BYTES = 1 << 30  # all images decoded to uint8
MAX_IMAGE_PIXELS = 4096 * 4096  # per image, checked from its header before decoding
MIN_SAMPLES = 10
MAX_CLASSES = 1000

ID_PATTERN = r"^[a-z0-9]{1,64}$"
DATA_FILE, META_FILE = "data.npz", "meta.json"
EXTENSIONS = {".csv": "csv", ".npz": "npz", ".zip": "imagefolder"}
ACCEPTED = ".csv (with label_column), .npz (arrays x and y), .zip (ImageFolder: one folder of images per class)"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
_GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")


class UploadError(ValueError):
    """The upload is malformed (422) or over a limit (413); field names the form field at fault."""

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


class NotFound(LookupError):
    """No uploaded dataset has this id."""


def upload_dir(data_dir: Path, upload_id: str) -> Path:
    if not re.match(ID_PATTERN, upload_id):  # the worker reaches here from a validated spec; be sure anyway
        raise NotFound(f"no uploaded dataset {upload_id!r}")
    return Path(data_dir) / "datasets" / "uploads" / upload_id


# --- storage -----------------------------------------------------------------------------------------

def store(f: BinaryIO, filename: str | None, data_dir: Path, label_column: str | None = None) -> dict:
    """Validate the uploaded file (seekable, e.g. UploadFile.file), store it normalised, return its meta."""
    kind = _format_of(filename)
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        raise UploadError("file", "is empty")
    if size > MAX_UPLOAD_BYTES:
        raise UploadError("file", f"is {_size(size)}, over the upload limit of {_size(MAX_UPLOAD_BYTES)} "
                                  "(TRAINYARD_MAX_UPLOAD_BYTES)", 413)
    if kind != "csv" and label_column is not None:
        raise UploadError("label_column", f"applies to .csv uploads only; a {kind} upload carries its labels")
    f.seek(0)
    if kind == "csv":
        x, y, classes = _parse_csv(f, label_column)
    elif kind == "npz":
        x, y, classes = _parse_npz(f)
    else:
        x, y, classes = _parse_imagefolder(f)

    upload_id = secrets.token_hex(8)
    final = upload_dir(data_dir, upload_id)
    tmp = final.parent / f".tmp-{upload_id}"
    tmp.mkdir(parents=True)
    try:
        with open(tmp / DATA_FILE, "wb") as out:
            np.savez(out, x=x, y=y)
            out.flush()
            os.fsync(out.fileno())
        meta = {"id": upload_id, "name": _display_name(filename), "format": kind, "samples": int(len(y)),
                "input_shape": list(x.shape[1:]), "classes": classes, "label_column": label_column,
                "created_at": datetime.now(timezone.utc).isoformat(), "bytes": size,
                "stored_bytes": (tmp / DATA_FILE).stat().st_size}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        os.replace(tmp, final)  # the dataset appears whole or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def get(data_dir: Path, upload_id: str) -> dict:
    try:
        return json.loads((upload_dir(data_dir, upload_id) / META_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise NotFound(f"no uploaded dataset {upload_id!r}") from None


def list_all(data_dir: Path) -> list[dict]:
    """Newest first. Half-written (.tmp-*) and half-deleted (.del-*) directories are not listed."""
    root = Path(data_dir) / "datasets" / "uploads"
    metas = []
    for entry in root.iterdir() if root.is_dir() else ():
        if re.match(ID_PATTERN, entry.name):
            try:
                metas.append(get(data_dir, entry.name))
            except NotFound:  # deleted while we looked
                pass
    return sorted(metas, key=lambda m: m["created_at"], reverse=True)


def delete(data_dir: Path, upload_id: str) -> None:
    """Remove an uploaded dataset. Jobs that name it are not checked: queued or running jobs that still
    have to load it fail with a JobError saying it was deleted (a job that has loaded it is unaffected)."""
    folder = upload_dir(data_dir, upload_id)
    doomed = folder.parent / f".del-{upload_id}-{time.time_ns()}"
    try:
        os.replace(folder, doomed)  # gone from the listing at once, even if the removal below is slow
    except FileNotFoundError:
        raise NotFound(f"no uploaded dataset {upload_id!r}") from None
    shutil.rmtree(doomed, ignore_errors=True)


def _format_of(filename: str | None) -> str:
    name = (filename or "").lower()
    for ext, kind in EXTENSIONS.items():
        if name.endswith(ext):
            return kind
    shown = repr(_display_name(filename)) if filename else "the file has no name; it"
    raise UploadError("file", f"{shown} has an unknown extension; accepted: {ACCEPTED}")


def _display_name(filename: str | None) -> str:
    base = re.split(r"[\\/]", filename or "")[-1]
    return re.sub(r"[^\w.\-+() ]", "_", base).strip()[:200] or "upload"


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 1 << 20 else f"{n / (1 << 20):,.1f} MiB"


def _check_labels(samples: int, classes) -> None:
    if samples < MIN_SAMPLES:
        raise UploadError("file", f"has {samples} samples; at least {MIN_SAMPLES} are needed to train and validate")
    if len(classes) < 2:
        raise UploadError("file", f"has {len(classes)} class ({', '.join(map(str, classes))}); "
                                  "at least 2 classes are needed")
    if len(classes) > MAX_CLASSES:
        raise UploadError("file", f"has {len(classes)} distinct labels; at most {MAX_CLASSES} classes are "
                                  "supported (is the label a class, not a measurement?)")


def _index_labels(values: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Distinct labels sorted (numerically when they are all numbers) -> int64 indices and their names."""
    uniq, inverse = np.unique(values, return_inverse=True)
    _check_labels(len(values), uniq)
    if uniq.dtype.kind == "U":
        numbers = [_number(v) for v in uniq.tolist()]
        if all(n is not None for n in numbers):  # "2" before "10"
            order = np.argsort(np.array(numbers), kind="stable")
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order))
            uniq, inverse = uniq[order], rank[inverse]
    return inverse.astype(np.int64).reshape(-1), [str(v) for v in uniq.tolist()]


def _number(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


# --- CSV ---------------------------------------------------------------------------------------------

def _parse_csv(f: BinaryIO, label_column: str | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    text = io.TextIOWrapper(f, encoding="utf-8-sig", newline="")
    try:
        return _read_csv(csv.reader(text), label_column)
    except UnicodeDecodeError as e:
        raise UploadError("file", f"is not UTF-8 text (byte {e.start} of a chunk: {e.reason})") from None
    except csv.Error as e:
        raise UploadError("file", f"is not a readable CSV: {e}") from None
    finally:
        text.detach()  # leave the upload's file open for its owner


def _read_csv(reader, label_column: str | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    header = next((row for row in reader if any(c.strip() for c in row)), None)
    if header is None:
        raise UploadError("file", "holds no rows")
    header = [c.strip() for c in header]
    if all(_number(c) is not None for c in header):
        raise UploadError("file", f"line {reader.line_num} must be a header naming the columns; "
                                  f"it is all numbers ({', '.join(header[:5])}...)")
    if len(header) < 2:
        hint = "; values must be separated by commas" if re.search(r"[;\t|]", header[0]) else ""
        raise UploadError("file", f"has {len(header)} column; it needs features and a label column{hint}")
    for i, name in enumerate(header):
        if not name:
            raise UploadError("file", f"header column {i + 1} has no name")
        if name in header[:i]:
            raise UploadError("file", f"header names column {name!r} twice")
    columns = ", ".join(header[:50]) + (", ..." if len(header) > 50 else "")
    if label_column is None:
        raise UploadError("label_column", f"is required for a .csv upload: the column holding the class "
                                          f"labels, one of: {columns}")
    if label_column not in header:
        raise UploadError("label_column", f"{label_column!r} is not a column of the CSV; its columns are: {columns}")

    label_at = header.index(label_column)
    features = [(i, name) for i, name in enumerate(header) if i != label_at]
    values, labels = array("f"), []
    for row in reader:
        if not any(c.strip() for c in row):
            continue
        where = f"row {len(labels) + 1} (line {reader.line_num})"
        if len(row) != len(header):
            raise UploadError("file", f"{where} has {len(row)} values; the header has {len(header)}")
        for i, name in features:
            v = _number(row[i])
            if v is None or abs(v) > 3.4e38:
                raise UploadError("file", f"column {name!r}, {where}: {row[i][:40]!r} is not a finite number "
                                          f"(every column but {label_column!r} must be numeric)")
            values.append(v)
        label = row[label_at].strip()
        if not label:
            raise UploadError("label_column", f"{label_column!r} is empty on {where}")
        labels.append(label)
    x = np.frombuffer(values, dtype=np.float32).reshape(len(labels), len(features))
    y, classes = _index_labels(np.array(labels, dtype=str))
    return x, y, classes


# --- .npz --------------------------------------------------------------------------------------------

def _parse_npz(f: BinaryIO) -> tuple[np.ndarray, np.ndarray, list[str]]:
    _open_zip(f, "a .npz")  # an .npz is a zip: bound its members before numpy inflates them
    f.seek(0)
    try:
        npz = np.load(f, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - numpy raises ValueError, OSError, EOFError... on junk
        raise UploadError("file", f"is not a readable .npz ({type(e).__name__}: {e})") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise UploadError("file", "is a single .npy array, not an .npz; save with np.savez(path, x=x, y=y)")
    with npz:
        missing = [k for k in ("x", "y") if k not in npz.files]
        if missing:
            raise UploadError("file", f"must hold arrays 'x' and 'y' (np.savez(path, x=x, y=y)); missing "
                                      f"{' and '.join(map(repr, missing))}; it has: {', '.join(npz.files) or 'none'}")
        x, y = (_npz_array(npz, k) for k in ("x", "y"))
    if x.dtype.kind not in "biuf":
        raise UploadError("file", f"x must be numeric; it has dtype {x.dtype}")
    if not 2 <= x.ndim <= 4 or 0 in x.shape[1:]:
        raise UploadError("file", f"x must have shape (samples, features...) with 2 to 4 dimensions; got "
                                  f"{x.shape} (one feature per sample: x.reshape(-1, 1))")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise UploadError("file", f"y must be one label per sample, shape (samples,); got {y.shape}")
    if len(x) != len(y):
        raise UploadError("file", f"x has {len(x)} samples but y has {len(y)}")
    if x.dtype != np.uint8 or x.ndim != 4:  # uint8 N x C x H x W stays pixels; anything else is features
        with np.errstate(over="ignore", invalid="ignore"):
            x = x.astype(np.float32)
        bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        if bad.any():
            raise UploadError("file", f"x has NaN or infinite values (or values too large for float32), "
                                      f"first in sample {int(np.argmax(bad))}")
    if y.dtype.kind == "f":
        if not np.isfinite(y).all() or (y != np.round(y)).any():
            raise UploadError("file", "y must hold class labels: integers or strings; it has non-integer floats")
        y = y.astype(np.int64)
    elif y.dtype.kind == "b":
        y = y.astype(np.int64)
    elif y.dtype.kind not in "iuUS":
        raise UploadError("file", f"y must hold class labels: integers or strings; it has dtype {y.dtype}")
    y, classes = _index_labels(y.astype(str) if y.dtype.kind == "S" else y)
    return np.ascontiguousarray(x), y, classes


def _npz_array(npz, key: str) -> np.ndarray:
    try:
        return npz[key]
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise UploadError("file", f"array {key!r} holds Python objects, which would need unpickling; "
                                      "only numeric arrays (and strings for y) are accepted") from None
        raise UploadError("file", f"array {key!r} is not readable: {e}") from None
    except Exception as e:  # noqa: BLE001 - corrupt members: zlib.error, BadZipFile, EOFError...
        raise UploadError("file", f"array {key!r} is not readable ({type(e).__name__}: {e})") from None


# --- ImageFolder zip ---------------------------------------------------------------------------------

def _open_zip(f: BinaryIO, what: str) -> zipfile.ZipFile:
    """The archive, once every member name is safe and the counts and inflated sizes are in bounds."""
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except Exception as e:  # noqa: BLE001 - BadZipFile, and ValueError/OSError on crafted headers
        raise UploadError("file", f"is not {what} (not a readable zip archive: {e})") from None
    if len(infos) > MAX_ARCHIVE_FILES:
        raise UploadError("file", f"holds {len(infos)} files; the limit is {MAX_ARCHIVE_FILES} "
                                  "(TRAINYARD_MAX_UPLOAD_FILES)", 413)
    for info in infos:
        name = info.filename
        parts = re.split(r"[\\/]", name)
        if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
            raise UploadError("file", f"member {name[:200]!r} has an absolute path")
        if ".." in parts:
            raise UploadError("file", f"member {name[:200]!r} has a '..' path component")
        if (info.external_attr >> 16) & 0o170000 == 0o120000:
            raise UploadError("file", f"member {name[:200]!r} is a symbolic link")
        if info.flag_bits & 0x1:
            raise UploadError("file", f"member {name[:200]!r} is encrypted")
    inflated = sum(i.file_size for i in infos)
    if inflated > MAX_UNCOMPRESSED_BYTES:
        raise UploadError("file", f"inflates to {_size(inflated)}; the limit is {_size(MAX_UNCOMPRESSED_BYTES)}", 413)
    return zf


def _parse_imagefolder(f: BinaryIO) -> tuple[np.ndarray, np.ndarray, list[str]]:
    zf = _open_zip(f, "a zip archive")
    members = []  # (path parts, info) of every image, junk such as __MACOSX/ and .DS_Store left out
    for info in zf.infolist():
        parts = [p for p in re.split(r"[\\/]", info.filename) if p]
        if info.is_dir() or not parts or any(p.startswith(".") or p == "__MACOSX" for p in parts):
            continue
        if parts[-1].lower().endswith(IMAGE_EXTENSIONS):
            members.append((parts, info))
    if not members:
        raise UploadError("file", f"holds no images ({', '.join(IMAGE_EXTENSIONS)}); an ImageFolder zip has "
                                  "one folder of images per class")
    # A zip of the dataset's folder itself: strip the common top folder(s) above the class folders.
    while len({p[0] for p, _ in members}) == 1 and all(len(p) >= 3 for p, _ in members):
        members = [(p[1:], info) for p, info in members]
    for parts, info in members:
        if len(parts) < 2:
            raise UploadError("file", f"image {info.filename[:200]!r} is not inside a class folder; an ImageFolder "
                                      "zip has one folder of images per class")
    members.sort(key=lambda m: m[0])
    classes = sorted({p[0] for p, _ in members})
    _check_labels(len(members), classes)  # before decoding anything
    index = {c: i for i, c in enumerate(classes)}
    y = np.array([index[p[0]] for p, _ in members], dtype=np.int64)

    x, first, gray = None, None, True
    for i, (_, info) in enumerate(members):
        img = _open_image(zf, info)
        if first is None:
            first = (info.filename, img.size)
            w, h = img.size
            if len(members) * 3 * h * w > MAX_DECODED_BYTES:
                raise UploadError("file", f"{len(members)} images of {w}x{h} decode to more than "
                                          f"{_size(MAX_DECODED_BYTES)}", 413)
            x = np.empty((len(members), 3, h, w), dtype=np.uint8)
        elif img.size != first[1]:
            raise UploadError("file", f"image {info.filename[:200]!r} is {img.size[0]}x{img.size[1]} pixels but "
                                      f"{first[0][:200]!r} is {first[1][0]}x{first[1][1]}; all images must have "
                                      "the same size (resize them before uploading)")
        gray = gray and img.mode in _GRAY_MODES
        try:
            x[i] = np.asarray(img.convert("RGB")).transpose(2, 0, 1)
        except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
            raise UploadError("file", f"image {info.filename[:200]!r} is not decodable "
                                      f"({type(e).__name__}: {e})") from None
    if gray:  # every image grayscale: one channel, not three copies of it
        x = np.ascontiguousarray(x[:, :1])
    return x, y, classes


def _open_image(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Image.Image:
    name = info.filename[:200]
    try:
        with zf.open(info) as member:
            raw = member.read(info.file_size + 1)
        img = Image.open(io.BytesIO(raw))  # reads the header only
    except Exception as e:  # noqa: BLE001 - PIL's UnidentifiedImageError, BadZipFile (CRC), zlib.error...
        raise UploadError("file", f"member {name!r} is not a readable image ({type(e).__name__}: {e})") from None
    w, h = img.size
    if w * h > MAX_IMAGE_PIXELS:
        raise UploadError("file", f"image {name!r} is {w}x{h} pixels; the limit is {MAX_IMAGE_PIXELS:,} per image",
                          413)
    return img
