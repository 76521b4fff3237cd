"""What an upload may cost, and the refusals, label indexing and sizes the three parsers share.

Every bound is here, so the README's Limits table and the code cannot drift apart. Memory: the
decoded data of one upload is at most `decoded(upload bytes)`, a fixed allowance plus a multiple
of the upload's own size (capped), and at most PARSE_SLOTS uploads are parsed at once.
"""
import math
from dataclasses import dataclass

import numpy as np

from trainyard.app.core.errors import Invalid, TooLarge, TrainyardError
from trainyard.app.core.settings import Settings

ACCEPTED = ".csv (with label_column), .npz (arrays x and y), .zip (ImageFolder: one folder of images per class)"
PARSE_SLOTS = 2


@dataclass(frozen=True)
class Limits:
    max_upload_bytes: int = 200 << 20    # TRAINYARD_MAX_UPLOAD_BYTES
    max_files: int = 100_000             # members of a zip or .npz: TRAINYARD_MAX_UPLOAD_FILES
    quota_bytes: int = 10 << 30          # stored bytes of all uploads: TRAINYARD_UPLOAD_QUOTA_BYTES
    max_uploads: int = 1000              # TRAINYARD_MAX_UPLOADS
    # One project's part of the two above (a member's upload): None, half of each, at least 1 (Settings.per_project).
    quota_bytes_per_project: int | None = None  # TRAINYARD_UPLOAD_QUOTA_BYTES_PER_PROJECT
    max_uploads_per_project: int | None = None  # TRAINYARD_MAX_UPLOADS_PER_PROJECT
    max_decoded_bytes: int = 1 << 30     # decoded data of one upload, whatever its size
    decode_allowance: int = 64 << 20     # ...and at most this plus decode_ratio x the upload's bytes
    decode_ratio: int = 16
    max_member_bytes: int = 64 << 20     # one image file inside a zip, inflated
    max_image_pixels: int = 4096 * 4096  # one image, read from its header before decoding
    max_columns: int = 10_000            # CSV columns (images belong in an .npz or a zip)
    max_label_chars: int = 200
    max_classes: int = 1000
    min_samples: int = 10

    @classmethod
    def from_settings(cls, s: Settings) -> "Limits":
        return cls(max_upload_bytes=s.max_upload_bytes, max_files=s.max_upload_files,
                   quota_bytes=s.upload_quota_bytes, max_uploads=s.max_uploads,
                   quota_bytes_per_project=s.per_project("upload_quota_bytes"),
                   max_uploads_per_project=s.per_project("max_uploads"))

    def project_part(self) -> tuple[int, int]:
        """One project's (uploads, stored bytes) at most."""
        return (self.max_uploads_per_project or max(1, self.max_uploads // 2),
                self.quota_bytes_per_project or max(1, self.quota_bytes // 2))

    def decoded(self, upload_bytes: int) -> int:
        """Bytes the data of an upload of this size may decode to."""
        return min(self.max_decoded_bytes, self.decode_allowance + self.decode_ratio * upload_bytes)


def refuse(field: str, message: str, too_large: bool = False) -> TrainyardError:
    """The error for a malformed upload (422) or one over a limit (413), naming the form field."""
    return (TooLarge if too_large else Invalid)(f"{field}: {message}", loc=(field,))


def size(n: int) -> str:
    return f"{n:,} bytes" if n < 1 << 20 else f"{n / (1 << 20):,.1f} MiB"


def check_decoded(nbytes: int, upload_bytes: int, limits: Limits, what: str) -> None:
    bound = limits.decoded(upload_bytes)
    if nbytes > bound:
        raise refuse("file", f"{what} decodes to {size(nbytes)}; an upload of {size(upload_bytes)} may decode to "
                             f"at most {size(bound)}", too_large=True)


def check_labels(samples: int, classes, limits: Limits) -> None:
    if samples < limits.min_samples:
        raise refuse("file", f"has {samples} samples; at least {limits.min_samples} are needed to train and validate")
    if len(classes) < 2:
        raise refuse("file", f"has {len(classes)} class ({', '.join(map(str, classes))}); at least 2 classes are "
                             "needed")
    if len(classes) > limits.max_classes:
        raise refuse("file", f"has {len(classes)} distinct labels; at most {limits.max_classes} classes are "
                             "supported (is the label a class, not a measurement?)")


def number(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def sorted_classes(names: list[str]) -> list[int]:
    """The order of class names: numerically when they are all numbers ("2" before "10"), else as text."""
    numbers = [number(n) for n in names]
    if all(v is not None for v in numbers):
        return sorted(range(len(names)), key=lambda i: (numbers[i], names[i]))
    return sorted(range(len(names)), key=lambda i: names[i])


class LabelIndex:
    """Labels -> class indices while streaming rows: a dict of the distinct labels (at most
    max_classes of at most max_label_chars each), never an array padded to the longest label."""

    def __init__(self, limits: Limits, field: str):
        self.limits, self.field = limits, field
        self.codes: dict[str, int] = {}

    def code(self, label: str, where: str) -> int:
        found = self.codes.get(label)
        if found is not None:
            return found
        if len(label) > self.limits.max_label_chars:
            raise refuse(self.field, f"a label on {where} has {len(label):,} characters; at most "
                                     f"{self.limits.max_label_chars} are allowed")
        if len(self.codes) >= self.limits.max_classes:
            raise refuse("file", f"has more than {self.limits.max_classes} distinct labels; at most "
                                 f"{self.limits.max_classes} classes are supported (is the label a class, not a "
                                 "measurement?)")
        self.codes[label] = len(self.codes)
        return self.codes[label]

    def finish(self, codes: np.ndarray, samples: int) -> tuple[np.ndarray, list[str]]:
        """(int64 class indices in sorted class order, class names)."""
        names = list(self.codes)
        check_labels(samples, names, self.limits)
        order = sorted_classes(names)
        rank = np.empty(len(names), dtype=np.int64)
        rank[order] = np.arange(len(names))
        return rank[codes], [names[i] for i in order]


def index_labels(values: np.ndarray, limits: Limits) -> tuple[np.ndarray, list[str]]:
    """An array of labels (numbers or strings, already bounded in bytes) -> int64 indices, class names."""
    uniq, inverse = np.unique(values, return_inverse=True)
    check_labels(len(values), uniq, limits)
    names = [str(v) for v in uniq.tolist()]
    if uniq.dtype.kind == "U":
        if max(map(len, names)) > limits.max_label_chars:
            raise refuse("file", f"y has a label of {max(map(len, names)):,} characters; at most "
                                 f"{limits.max_label_chars} are allowed")
        order = sorted_classes(names)
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return rank[inverse].reshape(-1), [names[i] for i in order]
    return inverse.astype(np.int64).reshape(-1), names
