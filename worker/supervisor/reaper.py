"""Every process a job starts ends with the job: its children, and theirs, double-forked and setsid'd too.

Orphans are kept inside the job's tree by child subreapers (prctl PR_SET_CHILD_SUBREAPER): a process
whose parent dies is adopted by its nearest subreaper ancestor instead of by init. Two are set:

- the job process (worker/runner.py): while it lives, every orphan of its tree becomes its child;
  when it ends on its own it kills them all (end_descendants(os.getpid())).
- the worker's fork server (set up by worker/warm.py, its preload): a job process that was killed
  outright (SIGKILL on cancel or memory, the kernel's OOM killer) leaves its descendants to the fork
  server, and the supervisor ends them once the job process is gone (end_descendants(fork server)).
  The fork server also dies with its worker (PR_SET_PDEATHSIG, SIGTERM): a worker SIGKILLed
  takes its fork server with it, which first ends every descendant it has (the job and its tree).

A process group or a session is not enough (setsid leaves both), nor is PR_SET_PDEATHSIG on a job's
children (a grandchild sets nothing). What this cannot catch: a process that leaves the tree of its
own accord through another subreaper, or the worker and its fork server SIGKILLed at the same
instant (a cgroup per job would: writable cgroups are rare in containers). Descendants are found
from /proc; torch-free.
"""
import ctypes
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterable
from types import FrameType

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# How long end_descendants keeps killing: a tree that forks faster than it dies gets this long.
END_WITHIN_S = 2.0


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def become_subreaper() -> None:
    """Orphaned descendants of this process are adopted by it, not by init."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
        found[int(name)] = (int(fields[1]), fields[0].decode())
    return found


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def fork_server_pid() -> int | None:
    """This process's multiprocessing fork server, if it started one (its pid is not public API)."""
    from multiprocessing import forkserver
    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def descendants(root: int) -> list[int]:
    """The live (not zombie) processes below root."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if table[pid][1] != "Z":
            found.append(pid)
        todo += children.get(pid, ())
    return found


def end_descendants(root: int, within: float = END_WITHIN_S) -> list[int]:
    """SIGKILL every process below root, again until none is left (a killed process's children are
    adopted by a subreaper of the tree and found by the next look). Returns those still alive."""
    return kill_until_gone(lambda: descendants(root), within)


def kill_until_gone(find: Callable[[], Iterable[int]], within: float, pause: float = 0.005) -> list[int]:
    """SIGKILL the processes find() names, and look again, until it names none or `within` seconds have
    passed. Returns those still there."""
    deadline = time.monotonic() + within
    while True:
        left = list(find())
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(pause)


def set_up_fork_server() -> None:
    """In the worker's fork server (worker/warm.py imports this there): adopt the orphans of job
    processes that were killed outright, and on the worker's death end every job process and their
    trees before exiting."""
    me, parent = os.getpid(), os.getppid()
    become_subreaper()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != me:  # a job process forked before it set its own handler: the default action
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if os.getppid() == parent:  # sent to every process (Slurm's scancel, systemd): the worker, alive, decides
            return
        end_descendants(me)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the worker died before the line above
        on_sigterm(signal.SIGTERM, None)
    # The fork server reaps the orphans it adopts and would warn about each ("unexpected pid").
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
