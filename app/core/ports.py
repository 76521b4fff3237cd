"""Free TCP ports for the listeners the project opens on ports of its own choosing: a throwaway service's
server (app/launcher.py) and the rendezvous of a job's ranks across hosts (worker/supervisor/part.py).

Both are picked now and bound later, by another process. A port that binding port 0 gives comes from the
kernel's ephemeral range, which every outgoing connection (a PostgreSQL client's, say) draws from too, so
one of those could take it in between: a test's server failed with "address already in use" that way.
A port below that range is taken only by another listener.
"""
import errno
import random
import socket
from pathlib import Path

LOWEST = 10000  # clear of the well-known and common service ports
TRIES = 200


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free on addr now, below the ephemeral range where one is free there. An addr that is not
    this host's (EADDRNOTAVAIL) is tried as every address: whoever binds it later says what is wrong."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    high = max(ephemeral_low(), LOWEST + 1)
    for _ in range(TRIES):
        port = random.randrange(LOWEST, high)
        with socket.socket(family) as s:
            try:
                s.bind((addr, port))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL and addr:
                    addr = ""
                continue
            return port
    with socket.socket(family) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]
