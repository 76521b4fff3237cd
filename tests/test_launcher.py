"""The launcher's pieces that tests and benchmarks lean on: free ports for throwaway services."""
import socket
from pathlib import Path

from trainyard.app import launcher


def test_a_free_port_is_bindable_and_outside_the_range_outgoing_connections_take():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = launcher.free_port()
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = launcher.free_port()
        picks = iter([taken, taken, free])
        monkeypatch.setattr(launcher.random, "randrange", lambda *a: next(picks))
        assert launcher.free_port() == free
