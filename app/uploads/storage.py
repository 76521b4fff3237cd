"""Uploaded datasets: store one (parsed, normalised, compressed, within the quotas), read, list and
delete them. The layout is app/core/layout.py's: datasets/uploads/<id>/ with data.npz and meta.json, in the
data directory or, with a bucket store (app/core/storage.py), published there from the data directory.

The id is made here; the client's filename is kept only as a display name, never as a path. A
dataset appears whole or not at all (written to a hidden directory, then renamed; in a bucket,
meta.json goes last and its presence lists the dataset), and the quota check and that rename happen
under one lock, so two uploads cannot both slip under the quota (a file lock: servers of one host;
servers on several hosts sharing a bucket may overshoot the quota by the uploads they race).

Each dataset belongs to the project and user that uploaded it (meta.json's project_id and owner): given who
asks, a read sees only that principal's project's datasets (admins: all), another's answering NotFound exactly
as a missing one; a dataset from before accounts (no project_id) is the admins' only. A member's upload meets their
project's part of the quotas first (Limits.project_part), then the quotas themselves; its refusal counts only
their project's uploads. Admins and uploads in no project meet the quotas themselves.
"""
import json
import os
import re
import secrets
import shutil
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

import numpy as np

from trainyard.app.accounts import Principal
from trainyard.app.core.errors import NotFound
from trainyard.app.core.layout import UPLOAD_DATA_FILE, UPLOAD_META_FILE, Layout, locked
from trainyard.app.core.storage import Store
from trainyard.app.uploads.csv_format import parse_csv
from trainyard.app.uploads.limits import ACCEPTED, PARSE_SLOTS, Limits, refuse, size
from trainyard.app.uploads.npz_format import parse_npz
from trainyard.app.uploads.zip_format import parse_imagefolder

EXTENSIONS = {".csv": "csv", ".npz": "npz", ".zip": "imagefolder"}
# Decoded uploads are the server's largest allocations: at most this many at once.
_parsing = threading.BoundedSemaphore(PARSE_SLOTS)


Where = Path | Store  # a data directory (its files are the store) or a store


def _store(where: Where) -> Store:
    return where if isinstance(where, Store) else Store(Layout(where))


def store(f: BinaryIO, filename: str | None, where: Where, label_column: str | None = None,
          limits: Limits = Limits(), who: Principal | None = None) -> dict:
    """Validate the uploaded file (seekable, e.g. UploadFile.file), store it normalised (as who's, in their
    project), return its meta."""
    kind = _format_of(filename)
    nbytes = f.seek(0, os.SEEK_END)
    if nbytes == 0:
        raise refuse("file", "is empty")
    if nbytes > limits.max_upload_bytes:
        raise refuse("file", f"is {size(nbytes)}, over the upload limit of {size(limits.max_upload_bytes)} "
                             "(TRAINYARD_MAX_UPLOAD_BYTES)", too_large=True)
    if kind != "csv" and label_column is not None:
        raise refuse("label_column", f"applies to .csv uploads only; a {kind} upload carries its labels")
    f.seek(0)
    with _parsing:
        if kind == "csv":
            x, y, classes = parse_csv(f, label_column, limits)
        elif kind == "npz":
            x, y, classes = parse_npz(f, limits, nbytes)
        else:
            x, y, classes = parse_imagefolder(f, limits, nbytes)
        meta = {"name": _display_name(filename), "format": kind, "samples": int(len(y)),
                "input_shape": list(x.shape[1:]), "classes": classes, "label_column": label_column,
                "pixels": bool(x.dtype == np.uint8 and x.ndim == 4), "bytes": nbytes,
                "project_id": who.project_id if who else None, "owner": who.user if who else None}
        return _write(_store(where), x, y, meta, limits, who)


def _write(store_: Store, x: np.ndarray, y: np.ndarray, meta: dict, limits: Limits, who: Principal | None) -> dict:
    layout = store_.layout
    upload_id = secrets.token_hex(8)
    final = layout.upload(upload_id)
    tmp = final.parent / f".tmp-{upload_id}"
    tmp.mkdir(parents=True)
    try:
        with open(tmp / UPLOAD_DATA_FILE, "wb") as out:
            np.savez_compressed(out, x=x, y=y)
            out.flush()
            os.fsync(out.fileno())
        meta = {"id": upload_id, **meta, "created_at": datetime.now(UTC).isoformat(),
                "stored_bytes": (tmp / UPLOAD_DATA_FILE).stat().st_size}
        (tmp / UPLOAD_META_FILE).write_text(json.dumps(meta, indent=1))
        with locked(layout.dataset_lock("uploads")):  # a file lock: several servers may share the data dir
            _check_quota(store_, meta["stored_bytes"], limits, who)
            os.replace(tmp, final)
            try:
                for name in (UPLOAD_DATA_FILE, UPLOAD_META_FILE):  # meta.json last: in a bucket it lists the dataset
                    store_.publish(final / name)
            except BaseException:
                shutil.rmtree(final, ignore_errors=True)
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _check_quota(store_: Store, adding: int, limits: Limits, who: Principal | None) -> None:
    metas = list_all(store_)
    if who is not None and not who.admin and who.project_id is not None:  # a member's: their project's part first
        own = [m for m in metas if m.get("project_id") == who.project_id]
        _check_project_part(f"project {who.project}", own, adding, limits)
        # Said without counts: what other projects keep is theirs.
        if len(metas) >= limits.max_uploads or sum(m["stored_bytes"] for m in metas) + adding > limits.quota_bytes:
            raise refuse("file", "the server keeps as many uploads as it allows (TRAINYARD_MAX_UPLOADS, "
                                 "TRAINYARD_UPLOAD_QUOTA_BYTES); try again later, or ask an admin", too_large=True)
        return
    if len(metas) >= limits.max_uploads:
        raise refuse("file", f"would be upload number {len(metas) + 1}; at most {limits.max_uploads} are kept "
                             "(TRAINYARD_MAX_UPLOADS): delete some first (DELETE /datasets/<id>)", too_large=True)
    used = sum(m["stored_bytes"] for m in metas)
    if used + adding > limits.quota_bytes:
        raise refuse("file", f"stores as {size(adding)}; uploads already take {size(used)} of the "
                             f"{size(limits.quota_bytes)} quota (TRAINYARD_UPLOAD_QUOTA_BYTES): delete some first "
                             "(DELETE /datasets/<id>)", too_large=True)


def _check_project_part(name: str, own: list[dict], adding: int, limits: Limits) -> None:
    """Refuse an upload past the project's part of the quotas, counting its own uploads (`own`) only."""
    count, quota = limits.project_part()
    if len(own) >= count:
        raise refuse("file", f"would be {name}'s upload number {len(own) + 1}; a project keeps at most {count} "
                             "(TRAINYARD_MAX_UPLOADS_PER_PROJECT): delete some of its own first "
                             "(DELETE /datasets/<id>)", too_large=True)
    used = sum(m["stored_bytes"] for m in own)
    if used + adding > quota:
        raise refuse("file", f"stores as {size(adding)}; {name}'s uploads already take {size(used)} of its "
                             f"{size(quota)} (TRAINYARD_UPLOAD_QUOTA_BYTES_PER_PROJECT): delete some of its own "
                             "first (DELETE /datasets/<id>)", too_large=True)


def upload_dir(data_dir: Path, upload_id: str) -> Path:
    return Layout(data_dir).upload(upload_id)


def _meta_key(store_: Store, upload_id: str) -> str:
    return f"{store_.layout.rel(store_.layout.upload(upload_id))}/{UPLOAD_META_FILE}"


def visible(meta: dict, who: Principal | None) -> bool:
    """Whether `who` may see (name, read, delete) the dataset of this meta; None: the service itself."""
    return who is None or who.sees(meta.get("project_id"))


def get(where: Where, upload_id: str, cached: bool = False, who: Principal | None = None) -> dict:
    """An upload's meta (NotFound: none, or one `who` may not see). From a bucket: read there (another host may
    have deleted it), or with cached from this host's copy where it has one (meta.json never changes once
    written)."""
    store_ = _store(where)
    key = _meta_key(store_, upload_id)
    try:
        if cached or not store_.remote:
            meta = json.loads(store_.fetch(key).read_text())
        else:
            meta = json.loads(store_.read_bytes(key))
    except (FileNotFoundError, NotADirectoryError):
        meta = None
    if meta is None or not visible(meta, who):
        raise NotFound(f"no uploaded dataset {upload_id!r}")
    return meta


def list_all(where: Where, who: Principal | None = None) -> list[dict]:
    """Newest first, those `who` may see. Half-written (.tmp-*) and half-deleted (.del-*) directories are not
    listed."""
    store_ = _store(where)
    if store_.remote:
        ids = [k.split("/")[-2] for k in store_.keys(store_.layout.rel(store_.layout.uploads()))
               if k.endswith("/" + UPLOAD_META_FILE)]
    else:
        root = store_.layout.uploads()
        ids = [entry.name for entry in (root.iterdir() if root.is_dir() else ())]
    metas = []
    for upload_id in ids:
        if re.fullmatch(r"[a-z0-9]{1,64}", upload_id):
            try:
                metas.append(get(store_, upload_id, cached=True, who=who))
            except NotFound:  # deleted while we looked, or another project's
                pass
    return sorted(metas, key=lambda m: m["created_at"], reverse=True)


def delete(where: Where, upload_id: str, who: Principal | None = None) -> None:
    """Remove an uploaded dataset (NotFound: none, or one `who` may not see). Jobs that name it are not checked:
    queued or running jobs that still have to load it fail with a JobError saying it was deleted (a job that has
    loaded it is unaffected)."""
    store_ = _store(where)
    if store_.remote or who is not None:
        get(store_, upload_id, who=who)  # NotFound if there is none (or it is another project's)
    if store_.remote:
        store_.delete(_meta_key(store_, upload_id))  # first: gone from every listing at once
        store_.delete_prefix(store_.layout.rel(store_.layout.upload(upload_id)))
        return
    folder = store_.layout.upload(upload_id)
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
    raise refuse("file", f"{shown} has an unknown extension; accepted: {ACCEPTED}")


def _display_name(filename: str | None) -> str:
    base = re.split(r"[\\/]", filename or "")[-1]
    return re.sub(r"[^\w.\-+() ]", "_", base).strip()[:200] or "upload"
