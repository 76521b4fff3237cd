"""Hosts on one machine, for `trainyard gpu-check`'s two-host step, the tests and the benchmarks: each a network
namespace of its own (`ip netns`) with an address on a bridge made for it, reaching the outside world
(PostgreSQL, the S3 server) only through the bridge's own address, where the caller forwards the ports it names
(socat). Cutting a host's link (`ip link set ... down`) is a host whose network went away.

Everything made here (namespaces, links, the bridge, the forwards, every process left in a namespace) is
removed on leaving `hosts()`, whatever happened. Making namespaces needs root; `unavailable()` says why
not, and the tests that need them skip with that reason.
"""
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from trainyard.app.launcher import Service
from trainyard.worker.supervisor import reaper


def unavailable() -> str | None:
    """None when this process can make network namespaces; else why not."""
    if os.geteuid() != 0:
        return "making network namespaces (ip netns add) needs root"
    missing = [tool for tool in ("ip", "socat") if shutil.which(tool) is None]
    return f"needs {', '.join(missing)} on PATH" if missing else None


def sh(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


@dataclass
class Host:
    name: str  # its namespace's name, and its TRAINYARD_NODE_NAME
    addr: str
    link: str  # the bridge's end of its veth pair: down, and the host is cut off

    def argv(self, *argv: str) -> list[str]:
        """argv run inside this host (`ip netns exec` execs it: the process keeps the pid Popen gives)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> set[int]:
        return {int(p) for p in sh("ip", "netns", "pids", self.name).split()}

    def cut(self) -> None:
        sh("ip", "link", "set", self.link, "down")

    def mend(self) -> None:
        sh("ip", "link", "set", self.link, "up")


@dataclass
class Network:
    bridge: str
    gateway: str  # the bridge's address: where the hosts reach what the caller forwards
    hosts: list[Host] = field(default_factory=list)
    forwards: list[subprocess.Popen] = field(default_factory=list)

    def forward(self, port: int) -> str:
        """127.0.0.1:port of this machine, reachable from every host at gateway:port."""
        # A session of its own: the children it forks per connection are killed with it (_stop), even those
        # whose connection hangs (a host cut off).
        proc = subprocess.Popen(["socat", f"TCP-LISTEN:{port},bind={self.gateway},reuseaddr,fork",
                                 f"TCP:127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.forwards.append(proc)
        deadline = time.monotonic() + 10
        while f"{self.gateway}:{port} " not in sh("ss", "-ltnH"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"socat could not forward {self.gateway}:{port}")
            time.sleep(0.05)
        return f"{self.gateway}:{port}"

    def start_worker(self, service: Service, host: Host, env: dict[str, str],
                     device: str = "cpu") -> subprocess.Popen:
        """A `trainyard worker` inside host, with service's settings and env over them; registered on return."""
        return service.start_worker(device, env={"TRAINYARD_NODE_NAME": host.name, **env}, wrap=host.argv())


def _free_subnet() -> ipaddress.IPv4Network:
    used = [ipaddress.ip_interface(w).network for line in sh("ip", "-o", "-4", "addr").splitlines()
            for w in line.split() if "/" in w and w[0].isdigit()]
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.{secrets.randbelow(56) + 200}.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.200-255.x.0/24 subnet for the hosts")


@contextmanager
def hosts(count: int) -> Iterator[Network]:
    """`count` hosts on a bridge of their own; all of it gone on leaving."""
    tag = secrets.token_hex(3)
    subnet = _free_subnet()
    addrs = [str(a) for a in subnet.hosts()]
    net = Network(bridge=f"tyb{tag}", gateway=addrs[0])
    with ExitStack() as undo:
        sh("ip", "link", "add", net.bridge, "type", "bridge")
        undo.callback(sh, "ip", "link", "del", net.bridge)
        sh("ip", "addr", "add", f"{net.gateway}/{subnet.prefixlen}", "dev", net.bridge)
        sh("ip", "link", "set", net.bridge, "up")
        undo.callback(_stop, net.forwards)
        for i in range(count):
            host = Host(name=f"ty{tag}h{i}", addr=addrs[i + 1], link=f"ty{tag}v{i}")
            sh("ip", "netns", "add", host.name)
            undo.callback(_remove, host)
            sh("ip", "link", "add", host.link, "type", "veth", "peer", "name", f"ty{tag}p{i}")
            sh("ip", "link", "set", host.link, "master", net.bridge, "up")
            sh("ip", "link", "set", f"ty{tag}p{i}", "netns", host.name)
            sh("ip", "-n", host.name, "link", "set", f"ty{tag}p{i}", "name", "eth0")
            sh("ip", "-n", host.name, "addr", "add", f"{host.addr}/{subnet.prefixlen}", "dev", "eth0")
            sh("ip", "-n", host.name, "link", "set", "eth0", "up")
            sh("ip", "-n", host.name, "link", "set", "lo", "up")
            net.hosts.append(host)
        yield net


def _stop(procs: list[subprocess.Popen]) -> None:
    """Each forward and every child it forked (its process group)."""
    for p in procs:
        _signal_group(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        _signal_group(p.pid, signal.SIGKILL)  # children still serving a connection


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _remove(host: Host) -> None:
    """Every process left in the host, then the host (its veth pair goes with it)."""
    reaper.kill_until_gone(host.pids, within=5, pause=0.1)
    sh("ip", "netns", "del", host.name)
    # The veth pair goes with the namespace, a moment later: delete it here unless it is gone already.
    subprocess.run(["ip", "link", "del", host.link], capture_output=True)
