"""Zip archives (ImageFolder uploads, and .npz files, which are zips): bounded before they are read.

The central directory's entry count comes from the End Of Central Directory record at the end of
the file, before zipfile builds an object for every entry; member names are checked (no absolute
paths, no '..', no links, no encryption); members are read with a cap, so a member that inflates
past it is refused however small its header says it is. Nothing is ever extracted to disk.
"""
import io
import re
import struct
import zipfile
from typing import BinaryIO

import numpy as np
from PIL import Image

from trainyard.app.uploads.limits import Limits, check_decoded, check_labels, refuse, size

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
_GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")
_EOCD, _EOCD64_LOCATOR, _EOCD64 = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"


# Central-directory bytes allowed per permitted file: a 46-byte entry plus a name and extras of
# ~210 bytes; more is a directory with more entries than its count admits.
_MAX_ENTRY = 256


def directory(f: BinaryIO) -> tuple[int, int] | None:
    """(entries, bytes) of the archive's central directory, as its end records state them; None if
    there are none. Read from the end of the file before zipfile builds an object per entry."""
    end = f.seek(0, io.SEEK_END)
    tail_start = max(0, end - (22 + 65535))  # the record, then a comment of at most 64 KiB
    f.seek(tail_start)
    tail = f.read()
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        return None
    count, cd_size = struct.unpack("<HI", tail[at + 10:at + 16])
    locator = tail.rfind(_EOCD64_LOCATOR, 0, at)
    if (count == 0xFFFF or cd_size == 0xFFFFFFFF) and locator >= 0 and at - locator == 20:
        (offset,) = struct.unpack("<Q", tail[locator + 8:locator + 16])  # zip64: counts in a record of their own
        f.seek(offset)
        record = f.read(56)
        if record[:4] == _EOCD64 and len(record) == 56:
            count, cd_size = struct.unpack("<QQ", record[32:48])
    return count, cd_size


def open_zip(f: BinaryIO, what: str, limits: Limits, upload_bytes: int) -> zipfile.ZipFile:
    """The archive, once its entry count, every member name and the inflated total are in bounds."""
    found = directory(f)
    if found is not None:
        count, cd_size = found
        if count > limits.max_files:
            raise refuse("file", f"holds {count} files; the limit is {limits.max_files} (TRAINYARD_MAX_UPLOAD_FILES)",
                         too_large=True)
        # zipfile reads entries until the directory's stated size is used up, whatever the count says.
        if cd_size > limits.max_files * _MAX_ENTRY:
            raise refuse("file", f"has a central directory of {size(cd_size)}, room for more than "
                                 f"{limits.max_files} files (TRAINYARD_MAX_UPLOAD_FILES)", too_large=True)
    f.seek(0)
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except Exception as e:
        raise refuse("file", f"is not {what} (not a readable zip archive: {e})") from None
    if len(infos) > limits.max_files:
        raise refuse("file", f"holds {len(infos)} files; the limit is {limits.max_files} "
                             "(TRAINYARD_MAX_UPLOAD_FILES)", too_large=True)
    for info in infos:
        _check_name(info)
    inflated, bound = sum(i.file_size for i in infos), limits.decoded(upload_bytes)
    if inflated > bound:  # as the headers say; read_member holds every member to its cap whatever they say
        raise refuse("file", f"inflates to {size(inflated)}; the limit is {size(bound)}", too_large=True)
    return zf


def _check_name(info: zipfile.ZipInfo) -> None:
    name = info.filename
    parts = re.split(r"[\\/]", name)
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise refuse("file", f"member {name[:200]!r} has an absolute path")
    if ".." in parts:
        raise refuse("file", f"member {name[:200]!r} has a '..' path component")
    if (info.external_attr >> 16) & 0o170000 == 0o120000:
        raise refuse("file", f"member {name[:200]!r} is a symbolic link")
    if info.flag_bits & 0x1:
        raise refuse("file", f"member {name[:200]!r} is encrypted")


def read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytes:
    """A member's bytes, refusing one that inflates past cap (whatever its header claims)."""
    try:
        with zf.open(info) as member:
            raw = member.read(cap + 1)
    except Exception as e:
        raise refuse("file", f"member {info.filename[:200]!r} is not readable ({type(e).__name__}: {e})") from None
    if len(raw) > cap:
        raise refuse("file", f"member {info.filename[:200]!r} inflates past {size(cap)}", too_large=True)
    return raw


def parse_imagefolder(f: BinaryIO, limits: Limits, upload_bytes: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    zf = open_zip(f, "a zip archive", limits, upload_bytes)
    members = _image_members(zf)
    classes = sorted({p[0] for p, _ in members})
    check_labels(len(members), classes, limits)  # before decoding anything
    index = {c: i for i, c in enumerate(classes)}
    y = np.array([index[p[0]] for p, _ in members], dtype=np.int64)
    cap = min(limits.max_member_bytes, limits.decoded(upload_bytes))
    x = np.empty((0, 3, 0, 0), dtype=np.uint8)  # sized by the first image
    first: tuple[str, tuple[int, int]] | None = None
    gray = True
    for i, (_, info) in enumerate(members):
        img = _open_image(read_member(zf, info, cap), info.filename, limits)
        if first is None:
            first = (info.filename, img.size)
            w, h = img.size
            check_decoded(len(members) * 3 * h * w, upload_bytes, limits, f"{len(members)} images of {w}x{h}")
            x = np.empty((len(members), 3, h, w), dtype=np.uint8)
        elif img.size != first[1]:
            raise refuse("file", f"image {info.filename[:200]!r} is {img.size[0]}x{img.size[1]} pixels but "
                                 f"{first[0][:200]!r} is {first[1][0]}x{first[1][1]}; all images must have the same "
                                 "size (resize them before uploading)")
        gray = gray and img.mode in _GRAY_MODES
        try:
            x[i] = np.asarray(img.convert("RGB")).transpose(2, 0, 1)
        except Exception as e:
            raise refuse("file", f"image {info.filename[:200]!r} is not decodable ({type(e).__name__}: {e})") from None
    if gray:  # every image grayscale: one channel, not three copies of it
        x = np.ascontiguousarray(x[:, :1])
    return x, y, classes


def _image_members(zf: zipfile.ZipFile) -> list[tuple[list[str], zipfile.ZipInfo]]:
    """(path parts below the class folders, info) of every image, junk such as __MACOSX/ left out, sorted."""
    members = []
    for info in zf.infolist():
        parts = [p for p in re.split(r"[\\/]", info.filename) if p]
        if info.is_dir() or not parts or any(p.startswith(".") or p == "__MACOSX" for p in parts):
            continue
        if parts[-1].lower().endswith(IMAGE_EXTENSIONS):
            members.append((parts, info))
    if not members:
        raise refuse("file", f"holds no images ({', '.join(IMAGE_EXTENSIONS)}); an ImageFolder zip has one folder "
                             "of images per class")
    # A zip of the dataset's folder itself: strip the common top folder(s) above the class folders.
    while len({p[0] for p, _ in members}) == 1 and all(len(p) >= 3 for p, _ in members):
        members = [(p[1:], info) for p, info in members]
    for parts, info in members:
        if len(parts) < 2:
            raise refuse("file", f"image {info.filename[:200]!r} is not inside a class folder; an ImageFolder zip "
                                 "has one folder of images per class")
    return sorted(members, key=lambda m: m[0])


def _open_image(raw: bytes, name: str, limits: Limits) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(raw))  # reads the header only
    except Exception as e:
        raise refuse("file", f"member {name[:200]!r} is not a readable image ({type(e).__name__}: {e})") from None
    w, h = img.size
    if w * h > limits.max_image_pixels:
        raise refuse("file", f"image {name[:200]!r} is {w}x{h} pixels; the limit is {limits.max_image_pixels:,} per "
                             "image", too_large=True)
    return img
