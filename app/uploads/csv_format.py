"""CSV uploads: a header row, numeric feature columns and a label column, read row by row.

Linear in the file: a set finds duplicate column names, labels are indexed as they stream past
(limits.LabelIndex), and features go straight into a float32 buffer (4 bytes for every value,
which takes at least 2 bytes of the file).
"""
import csv
import io
import re
from array import array
from typing import BinaryIO

import numpy as np

from trainyard.app.uploads.limits import LabelIndex, Limits, number, refuse

FLOAT32_MAX = 3.4e38


def parse_csv(f: BinaryIO, label_column: str | None, limits: Limits) -> tuple[np.ndarray, np.ndarray, list[str]]:
    text = io.TextIOWrapper(f, encoding="utf-8-sig", newline="")
    try:
        return _read(csv.reader(text), label_column, limits)
    except UnicodeDecodeError as e:
        raise refuse("file", f"is not UTF-8 text (byte {e.start} of a chunk: {e.reason})") from None
    except csv.Error as e:
        raise refuse("file", f"is not a readable CSV: {e}") from None
    finally:
        text.detach()  # leave the upload's file open for its owner


def _read(reader, label_column: str | None, limits: Limits) -> tuple[np.ndarray, np.ndarray, list[str]]:
    header = _header(reader, limits)
    columns = ", ".join(h[:40] for h in header[:50]) + (", ..." if len(header) > 50 else "")
    if label_column is None:
        raise refuse("label_column", f"is required for a .csv upload: the column holding the class labels, one "
                                     f"of: {columns}")
    if label_column not in header:
        raise refuse("label_column", f"{label_column!r} is not a column of the CSV; its columns are: {columns}")
    label_at = header.index(label_column)
    features = [(i, name) for i, name in enumerate(header) if i != label_at]
    values, codes, labels = array("f"), array("q"), LabelIndex(limits, "label_column")
    for row in reader:
        if not any(c.strip() for c in row):
            continue
        where = f"row {len(codes) + 1} (line {reader.line_num})"
        if len(row) != len(header):
            raise refuse("file", f"{where} has {len(row)} values; the header has {len(header)}")
        for i, name in features:
            v = number(row[i])
            if v is None or abs(v) > FLOAT32_MAX:
                raise refuse("file", f"column {name!r}, {where}: {row[i][:40]!r} is not a finite number "
                                     f"(every column but {label_column!r} must be numeric)")
            values.append(v)
        label = row[label_at].strip()
        if not label:
            raise refuse("label_column", f"{label_column!r} is empty on {where}")
        codes.append(labels.code(label, where))
    x = np.frombuffer(values, dtype=np.float32).reshape(len(codes), len(features))
    y, classes = labels.finish(np.frombuffer(codes, dtype=np.int64), len(codes))
    return x, y, classes


def _header(reader, limits: Limits) -> list[str]:
    header = next((row for row in reader if any(c.strip() for c in row)), None)
    if header is None:
        raise refuse("file", "holds no rows")
    header = [c.strip() for c in header]
    if len(header) > limits.max_columns:
        raise refuse("file", f"has {len(header):,} columns; at most {limits.max_columns:,} are allowed (upload "
                             "images as an .npz or an ImageFolder zip)", too_large=True)
    if all(number(c) is not None for c in header):
        raise refuse("file", f"line {reader.line_num} must be a header naming the columns; it is all numbers "
                             f"({', '.join(header[:5])}...)")
    if len(header) < 2:
        hint = "; values must be separated by commas" if re.search(r"[;\t|]", header[0]) else ""
        raise refuse("file", f"has {len(header)} column; it needs features and a label column{hint}")
    seen: set[str] = set()
    for i, name in enumerate(header):
        if not name:
            raise refuse("file", f"header column {i + 1} has no name")
        if name in seen:
            raise refuse("file", f"header names column {name[:100]!r} twice")
        seen.add(name)
    return header
