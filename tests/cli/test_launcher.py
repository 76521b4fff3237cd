"""Free ports for the listeners the project opens on ports of its own choosing (app/core/ports.py): throwaway
services' servers and the rendezvous of a job's ranks across hosts."""
import socket

import pytest

from trainyard.app import launcher
from trainyard.app.core import ports


def test_a_free_port_is_bindable_and_outside_the_range_outgoing_connections_take():
    low = ports.ephemeral_low()
    assert low == int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(20):
        port = launcher.free_port()
        assert ports.LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = ports.free_port()
        picks = iter([taken, taken, free])
        monkeypatch.setattr(ports.random, "randrange", lambda *a: next(picks))
        assert launcher.free_port() == free


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_the_rendezvous_port_is_free_on_the_hosts_address_and_below_the_ephemeral_range(addr):
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind((addr, 0))
    except OSError:
        pytest.skip(f"{addr} is not an address of this machine")
    for _ in range(20):
        port = ports.free_port(addr)
        assert ports.LOWEST <= port < ports.ephemeral_low()
        with socket.socket(family) as s:
            s.bind((addr, port))


def test_an_address_not_of_this_host_still_gets_a_port_below_the_ephemeral_range():
    # 192.0.2.0/24 is TEST-NET-1: no host has it. Rank 0's own check names the address when the job starts.
    port = ports.free_port("192.0.2.7")
    assert ports.LOWEST <= port < ports.ephemeral_low()
    with socket.socket() as s:
        s.bind(("", port))
