"""Uploaded datasets: a CSV, an .npz or an ImageFolder zip, validated in bounded memory and stored
normalised (x: float32 features or uint8 pixels; y: int64 class indices 0..k-1), compressed.

storage.py keeps them on disk within the quotas; csv_format, npz_format and zip_format parse the
three formats; limits.py holds every bound. Untrusted input is parsed without unpickling and zips
are read in memory, never extracted. Imports neither torch nor FastAPI: the worker reads the
stored files through the same layout.
"""
from trainyard.app.core.layout import UPLOAD_DATA_FILE as DATA_FILE
from trainyard.app.core.layout import UPLOAD_META_FILE as META_FILE
from trainyard.app.uploads.limits import ACCEPTED, Limits
from trainyard.app.uploads.storage import delete, get, list_all, store, upload_dir, visible

ID_PATTERN = r"^[a-z0-9]{1,64}$"

__all__ = ["ACCEPTED", "DATA_FILE", "ID_PATTERN", "META_FILE", "Limits", "delete", "get", "list_all", "store",
           "upload_dir", "visible"]
