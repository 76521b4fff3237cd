"""The operators' admin token a server on the network makes for itself: `<data_dir>/api-token`.

A server that answers only this machine's loopback may run without TRAINYARD_API_TOKEN (the person at the
machine is the admin: app/api/deps.py). One listening on any other address never runs open: when no token is
set, `trainyard serve` makes one here (256 random bits, the file readable by its owner only) on its first
start and keeps it for every later one, and says where it is, never what it is (logs travel further than the
data directory). Settings read it when TRAINYARD_API_TOKEN is unset, so every server process on the data
directory and a client on this machine (app/client/__init__.py, talking to loopback) use the same one. Torch-free.
"""
import ipaddress
import os
import secrets
from pathlib import Path

FILE = "api-token"


def path(data_dir: Path) -> Path:
    return Path(data_dir) / FILE


def read(data_dir: Path) -> str | None:
    """The stored token, or None when there is none (or it cannot be read: another user's data directory)."""
    try:
        token = path(data_dir).read_text().strip()
    except OSError:
        return None
    return token or None


def ensure(data_dir: Path) -> tuple[str, bool]:
    """The stored token, made now if there is none: (token, made now)."""
    found = read(data_dir)
    if found:
        return found, False
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL: two server processes starting at once must not each write a token of their own.
    try:
        fd = os.open(path(data_dir), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read(data_dir) or token, False
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def loopback(host: str) -> bool:
    """Whether a listening address (or a URL's host) is this machine's loopback only. 0.0.0.0 and :: are
    every interface, a name other than localhost may resolve anywhere: neither is loopback."""
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback
