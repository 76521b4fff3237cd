"""Jobs on several devices of one host: one process per rank, gradients all-reduced (DDP).

Rank 0 is the job process its supervisor started and watches. Before it touches a device it forks
the other ranks (fork, not spawn: the fork server already paid for `import torch`, and CUDA is
still untouched), and they die with it (PR_SET_PDEATHSIG): a kill or a cancel of the job stops
every rank. A rank that fails sends its error to rank 0 and exits; rank 0's watch reports that
error as the job's and ends the job process, so no rank waits on a collective that cannot finish.
The ranks meet through a file store beside the run's checkpoints, or, given rank 0's address
(`master`, for ranks on several hosts), through torch's own TCPStore there; NCCL on CUDA and gloo on
the CPU (plus a gloo group for the stop vote, worker/stop_vote.py, so that vote never waits for the GPU), over the
interface NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name where set. Only rank 0 reports, checkpoints and
writes the artifact. The TCPStore has no authentication: what the other ranks send rank 0 is tensors
and JSON (gather), never a pickle, and the hosts' ports are for the fleet alone (docs/scaling-out.md).
"""
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainyard.app.core.states import ErrorRecord, Failure, error_record
from trainyard.worker.errors import RankMessageRefused, RendezvousFailed

PR_SET_PDEATHSIG = 1
# Collectives wait this long for a missing rank (TRAINYARD_COLLECTIVE_TIMEOUT_S, read once); a rank that dies is
# noticed at once by rank 0's watch, and rank 0's solo work is waited for by the store (worker/leader_wait.py).
TIMEOUT = timedelta(seconds=float(v) if (v := os.environ.get("TRAINYARD_COLLECTIVE_TIMEOUT_S", "")).replace(
    ".", "", 1).isdigit() and 0 < float(v) <= 86400 else 600)  # a value past sense is ignored, not a dead import
# Ranks meeting at rank 0's address wait this long for each other: an address that cannot be reached fails
# the run then (RendezvousFailed), not at the collectives' timeout.
RENDEZVOUS_S = 60.0
# Rank 0 whose collective broke waits this long for the rank that broke it to report why.
REASON_WAIT_S = 2.0
TERMINAL = ("done", "error", "preempted")
# The most a rank sends rank 0 through gather() (each rank's random states take ~7 KB): rank 0 sets this
# much aside per rank, so a larger size announced by a rogue peer is refused before anything is allocated.
MAX_MESSAGE_BYTES = 1 << 20


@dataclass
class World:
    """This process's place among a job's ranks. size 1: a one-device job, nothing distributed."""
    rank: int = 0
    size: int = 1
    control: Any = field(default=None, repr=False)  # the gloo group the stop vote and checkpoint RNG states use
    local_rank: int = 0  # its place among its host's ranks

    @property
    def leader(self) -> bool:
        return self.rank == 0


class RankWatch:
    """Rank 0's view of the other ranks: forwards rank 0's events, and turns a rank's failure into the job's
    error event (naming the rank: "rank") before ending the job process. A rank's broken link (RankLost from its
    collective) waits REASON_WAIT_S for another rank's own failure, its cause, which then is the job's error."""

    def __init__(self, emit: Callable[[dict], None]):
        self._emit = emit
        self._lock = threading.Lock()
        self._ended = False
        self._rank_failed = threading.Event()
        self._cause = threading.Event()  # a rank failed of its own cause, not of a broken link

    def emit(self, event: dict) -> None:
        if event.get("type") == "error" and self._rank_failed.wait(REASON_WAIT_S):
            # Rank 0's own error is the broken collective; the rank that broke it reports, then exits us.
            time.sleep(REASON_WAIT_S * 5)
        with self._lock:
            if self._ended:
                return
            self._ended = event.get("type") in TERMINAL
            self._emit(event)

    def watch(self, rank: int, pid: int, errors: int) -> None:
        threading.Thread(target=self._wait, args=(rank, pid, errors), daemon=True, name=f"rank-{rank}").start()

    def _wait(self, rank: int, pid: int, errors: int) -> None:
        _, status = os.waitpid(pid, 0)
        with os.fdopen(errors, "rb") as f:
            sent = f.read()
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            return
        self._rank_failed.set()
        # Dead without a word (a signal: SIGKILL, or SIGABRT from NCCL's watchdog when the communicator broke).
        how = f"was killed by signal {-code} ({signal.strsignal(-code)})" if code < 0 else f"exited with status {code}"
        error: ErrorRecord = json.loads(sent) if sent else error_record(Failure.INFRASTRUCTURE, "RankLost",
                                                                        f"pid {pid} {how}")
        if not (sent and error.get("type") == "RankLost"):
            self._cause.set()
        elif self._cause.wait(REASON_WAIT_S):
            return  # the rank that broke the link reports, and ends the job process
        with self._lock:
            if not self._ended:
                self._ended = True
                self._emit({"type": "error", "error": {**error, "rank": rank,
                                                       "message": f"rank {rank}: {error['message']}"}})
        os._exit(1)


def fork_ranks(size: int, emit: Callable[[dict], None],
               local: tuple[int, ...] = ()) -> tuple[World, Callable[[dict], None]]:
    """In the job process (rank 0, or on another host the first of its ranks): fork this host's other
    ranks (`local`, the first being this process's; (): all, 0..size-1). Returns this process's World and
    the emit it uses: the job process's goes through its RankWatch, a forked rank's sends only its error,
    to the job process."""
    local = local or tuple(range(size))
    watch = RankWatch(emit)
    for i, rank in enumerate(local[1:], 1):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _die_with_parent()
            return World(rank, size, local_rank=i), _rank_emit(write_end)
        os.close(write_end)
        watch.watch(rank, pid, read_end)
        emit({"type": "log", "line": f"rank {rank} pid {pid}"})  # the job's log names every rank's process
    return World(local[0], size), watch.emit


def rank_environment(device: str, uuid: str | None) -> tuple[dict[str, str], str]:
    """What a rank sets in its environment before anything touches CUDA, and the device it then uses: a
    GPU rank sees only its own GPU (CUDA_VISIBLE_DEVICES=<its UUID>) and uses it as cuda:0. By UUID
    because a lent worker's `cuda:N` is numbered under its own CUDA_VISIBLE_DEVICES, not rank 0's:
    workers pinned one GPU each are all cuda:0. A CPU rank, or a GPU known by no UUID, changes nothing."""
    if device.startswith("cuda") and uuid:
        return {"CUDA_VISIBLE_DEVICES": uuid}, "cuda:0"
    return {}, device


def pin(device: str, uuid: str | None) -> str:
    """rank_environment() applied to this process; returns the device to use."""
    env, device = rank_environment(device, uuid)
    os.environ.update(env)
    return device


def use_interface(addr: str) -> None:
    """Across hosts, gloo and NCCL must use the interface that holds this host's address (TRAINYARD_NODE_ADDR):
    left to themselves they take the one the hostname resolves to, which may be loopback or a private
    network the other hosts cannot reach. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set by hand win."""
    name = interface_of(addr) if addr else None
    if name:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, name)


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 address addr on this host (None: none does, or addr is a name)."""
    try:
        wanted = socket.inet_aton(addr)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address, bytes 20-24 of the struct ifreq it fills
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:  # no IPv4 address on it
                continue
            if got == wanted:
                return name
    return None


def _rank_emit(fd: int) -> Callable[[dict], None]:
    def emit(event: dict) -> None:
        if event.get("type") == "error":
            os.write(fd, json.dumps(event["error"]).encode())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    return emit


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # rank 0 died before the line above: follow it
        os._exit(1)


def init(world: World, device: torch.device, store: Path, master: str = "",
         rendezvous_s: float = RENDEZVOUS_S) -> None:
    """Join the job's process group (every rank calls this once, before building the model): through the
    file `store`, or through a TCPStore at `master` ("addr:port", rank 0's) when one is given."""
    if world.size == 1:
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if master:
        dist.init_process_group(backend, store=tcp_store(world, master, rendezvous_s), rank=world.rank,
                                world_size=world.size, timeout=TIMEOUT)
    else:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=world.rank, world_size=world.size,
                                timeout=TIMEOUT)
    # A group of its own for the stop vote and the checkpoint's RNG states: on the CPU, so it never waits
    # for the GPU, and apart from DDP's gradient all-reduces, so a vote never queues behind them.
    world.control = dist.new_group(backend="gloo")


def tcp_store(world: World, master: str, rendezvous_s: float) -> dist.TCPStore:
    """torch's TCPStore at master: rank 0 serves it, the others connect; every rank returns once all have
    come, or raises RendezvousFailed naming the address after rendezvous_s."""
    host, _, port = master.rpartition(":")
    try:
        if world.leader:  # an address that is not this host's fails now, not after every rank's wait
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host.strip("[]"), int(port)))
        return dist.TCPStore(host.strip("[]"), int(port), world.size, is_master=world.leader,
                             timeout=timedelta(seconds=rendezvous_s), wait_for_workers=True)
    except (RuntimeError, OSError, ValueError) as exc:  # torch's DistStoreError is a RuntimeError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        role = "serve" if world.leader else "reach"
        raise RendezvousFailed(f"rank {world.rank} of {world.size} could not {role} the job's rendezvous at "
                               f"{master} within {rendezvous_s:g} s: {first}") from exc


def any_true(flag: bool, world: World) -> bool:
    """True on every rank when it is true on any (a stop request reaches rank 0 only). On the CPU: it
    never waits for the device."""
    if world.size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.control)
    return bool(t.item())


def total(values: torch.Tensor, world: World) -> torch.Tensor:
    """values summed over the ranks (values itself when there is one)."""
    if world.size == 1:
        return values
    out = values.clone()
    dist.all_reduce(out)
    return out


def gather(obj: Any, world: World) -> list[Any] | None:
    """Every rank's obj (JSON: a tuple arrives a list, at any world size), in rank order, on rank 0 (None
    elsewhere). As JSON in uint8 tensors, never pickled: any process that reaches the TCPStore may join,
    and what it sends rank 0 must be bytes to refuse, not code to run (gather_object unpickles). Its
    collectives are gather_object's (sizes all-gathered, then the padded bytes gathered), so a peer that
    speaks pickle is refused at once (RankMessageRefused), not waited for until the timeout."""
    data = json.dumps(obj).encode()
    if world.size == 1:
        return [json.loads(data)]
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world.size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=world.control)
    lengths = [int(s.item()) for s in sizes]
    for rank, n in enumerate(lengths):  # every rank sees every size: all refuse together, none waits
        if not 0 < n <= MAX_MESSAGE_BYTES:
            raise RankMessageRefused(f"rank {rank} would send rank 0 {n} bytes; a rank's message is 1 to "
                                     f"{MAX_MESSAGE_BYTES} bytes of JSON")
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world.size)] if world.leader else None
    dist.gather(mine, out, dst=0, group=world.control)
    if out is None:
        return None
    return [_decode(rank, t[:n]) for rank, (t, n) in enumerate(zip(out, lengths))]


def _decode(rank: int, sent: torch.Tensor) -> Any:
    try:
        return json.loads(sent.numpy().tobytes().decode())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RankMessageRefused(f"rank {rank} sent rank 0 {sent.numel()} bytes that are not JSON (ranks' "
                                 f"results travel as JSON, never pickled): refused unread") from exc


def shard(idx: torch.Tensor, world: World) -> tuple[torch.Tensor, int, float]:
    """This rank's part of a global batch of sample indices: (indices, samples it counts, loss scale).

    DDP averages the ranks' gradients; scaling each rank's mean loss by its share of the batch times
    the world size makes that average the gradient of the whole batch's mean loss, as one process
    taking the whole batch would get. A rank left without samples (a last batch smaller than the
    world) steps on the batch with scale 0: it must still take part in the all-reduce.
    """
    part = idx.tensor_split(world.size)[world.rank]
    if len(part) == 0:
        return idx, 0, 0.0
    return part, len(part), len(part) * world.size / len(idx)
