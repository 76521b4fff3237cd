"""A real Slurm cluster on this machine for the tests (Debian's slurm-wlm 22.05 and munge): `slurm_cluster(n)`
starts it and removes everything it made on leaving, whatever happened.

Layout. Each node is a network namespace of app/cli/netns.py on a bridge of its own; the node's name is its
namespace's name. slurmctld and one munged run on this machine (the root namespace), slurmctld reached by the
nodes at the bridge's address; every node's slurmd talks to that munged through its socket (a file, which
network namespaces share). Everything else lives in one temp dir (conf/, munge/, state/, spool/<node>/, log/,
work/), so two clusters (pytest-xdist) never share a file, a port or a munge socket. Commands run on this
machine with SLURM_CONF (`SlurmCluster.env`); a job runs inside a node, as root, with the submitter's
environment and working directory (slurm-N.out lands there), and reaches 127.0.0.1's services only where
`network.forward(port)` forwards them, at the bridge's address.

What it takes, found by trying:
- slurmd will not start without cgroups (22.05 has no CgroupPlugin=disabled): cgroup.conf says cgroup/v1
  without automount, and each slurmd runs in a mount namespace of its own (`unshare --mount` inside
  `ip netns exec`) over a tmpfs on /sys/fs/cgroup, which so never covers the machine's own.
- `unshare --uts` gives each node its hostname; /etc/netns/<ns>/hosts (bind-mounted over /etc/hosts by
  `ip netns exec`) resolves the nodes and this machine there.
- SlurmctldHost is this machine's real hostname (slurmctld checks it) with the bridge address in parentheses.
- munged wants every directory above its socket world-searchable and its key 0600.
- ProctrackType=proctrack/linuxproc (a job's processes are found by parentage, so scancel kills them all, but
  not one that left the tree: `(setsid cmd &)` escapes), TaskPlugin=task/none, SlurmdParameters=config_overrides
  (the declared CPUs and memory, not the machine's), per-node spool, log and pid files (%n).
- Ending a job (scancel, time limit, preemption): SIGTERM, then SIGKILL KillWait=5 s later; the job shows
  COMPLETING meanwhile and its final state (CANCELLED, TIMEOUT) once its processes are gone. OverTimeLimit=0,
  but limits are whole minutes, looked at every 30 s: a `--time=1` job ends 60-90 s after it started.
- A node whose slurmd is killed goes DOWN about SlurmdTimeout + 3 x MessageTimeout (3 s here, 10 by default)
  after its last answer: 15-19 s with SlurmdTimeout=10. A `--requeue` batch job on it goes back to PENDING
  (Restarts=1; the completion log says NODE_FAIL), a `--no-requeue` one ends NODE_FAIL. Their processes run on
  until the slurmd returns (ReturnToService=2: the node is IDLE again at once), which kills them.
- A requeued job (a lost node, preemption, `scontrol requeue`) may start again CredExpire later: 10 s here
  (AuthInfo=cred_expire=10; Slurm's default is 120); the schedulers look every 2 s (backfill) and 5 s.
- No slurmdbd, so no sacct: squeue (completed jobs stay listed MinJobAge=300 s) and the job-completion log
  (`jobcomp_log`, JobCompType=jobcomp/filetxt: a line per run, so PREEMPTED or NODE_FAIL before a rerun) are
  what to count on.
- Preemption: partitions `main` (the default, PriorityTier=1) and `urgent` (PriorityTier=2, PreemptMode=OFF)
  over all nodes, PreemptType=preempt/partition_prio, PreemptMode=REQUEUE: a job in `urgent` that needs a
  running `main` job's CPUs requeues it (SIGTERM, KillWait, SIGKILL) within about 3 s.
"""
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.app.cli import netns
from trainyard.app.core.ports import free_port

DAEMONS = ("slurmctld", "slurmd", "munged", "munge")
KILL_WAIT_S = 5  # between a job's SIGTERM and its SIGKILL (scancel, a time limit, preemption)
CRED_EXPIRE_S = 10  # how long a requeued job waits before it may start again (Slurm's default: 120)
MESSAGE_TIMEOUT_S = 3  # a dead slurmd's node goes DOWN about SlurmdTimeout + 3 x this after its last answer


def unavailable() -> str | None:
    """None when a cluster can start here; else why not (the tests skip with it)."""
    if why := netns.unavailable():
        return why
    missing = [d for d in DAEMONS + ("sbatch", "unshare") if shutil.which(d) is None]
    return f"needs {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else None


@dataclass
class SlurmCluster:
    network: netns.Network  # the bridge and hosts; .forward(port) to reach a service of 127.0.0.1 from the nodes
    nodes: list[str]  # the node names, as sinfo shows them: the hosts' names
    partition: str  # the default partition, holding all nodes
    preempting_partition: str  # a partition over the same nodes whose jobs requeue `partition`'s
    env: dict[str, str]  # what a process on this machine needs to use Slurm's commands: os.environ | env
    conf_dir: Path
    log_dir: Path
    work_dir: Path  # run()'s default working directory: slurm-N.out lands here
    root: Path  # the temp dir holding all of it
    slurmd: dict[str, subprocess.Popen] = field(default_factory=dict)
    daemons: list[subprocess.Popen] = field(default_factory=list)  # munged, slurmctld

    @property
    def jobcomp_log(self) -> Path:
        return self.log_dir / "jobcomp.log"

    def host(self, node: str) -> netns.Host:
        return next(h for h in self.network.hosts if h.name == node)

    def addr(self, node: str) -> str:
        return self.host(node).addr

    def run(self, *argv: str, check: bool = True, timeout: float = 30, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm command (sbatch, squeue, scancel, sinfo, scontrol, srun) on this machine, with env over
        this cluster's (cwd: work_dir unless given)."""
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd or self.work_dir,
                           env={**os.environ, **self.env, **(env or {})})
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> int:
        """Submit a batch job (sbatch's arguments, e.g. "--wrap=..."), from cwd with env over this process's
        (the job gets both: sbatch exports the submitter's environment); its id."""
        return int(self.run("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Reason, NodeList, Restarts, ...); {} once forgotten."""
        r = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(w.split("=", 1) for w in r.stdout.split() if "=" in w) if r.returncode == 0 else {}

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo prints it (idle, alloc, mix, down*, ...)."""
        out = self.run("sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines())

    def wait(self, ready, timeout: float, what: str, pause: float = 0.2):
        """ready()'s first truthy answer within timeout seconds, else an error naming what was awaited."""
        deadline = time.monotonic() + timeout
        while not (got := ready()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout} s ({self._describe()})")
            time.sleep(pause)
        return got

    def _describe(self) -> str:
        try:
            return f"nodes: {self.node_states()}"
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            return f"sinfo: {e}"

    def wait_idle(self, timeout: float = 30) -> None:
        """Every node IDLE (after start, after a node's return)."""
        def idle() -> bool:
            for node, proc in self.slurmd.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{node}'s slurmd exited {proc.returncode}: "
                                       + (self.log_dir / f"slurmd-{node}.out").read_text()[-2000:])
            return set(self.node_states().values()) == {"idle"}
        self.wait(idle, timeout, "every node idle")

    def wait_job(self, job_id: int, states: set[str], timeout: float = 30) -> dict[str, str]:
        """The job's fields once its JobState is one of states."""
        return self.wait(lambda: (j := self.job(job_id)).get("JobState") in states and j, timeout,
                         f"job {job_id} {'/'.join(sorted(states))}")

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL the node's slurmd (its jobs' processes run on)."""
        proc = self.slurmd.pop(node)
        proc.kill()
        proc.wait()

    def start_slurmd(self, node: str) -> None:
        """The node's slurmd, in a UTS and mount namespace of its own inside the node's network namespace."""
        assert node not in self.slurmd, f"{node}'s slurmd runs already"
        conf = self.conf_dir / "slurm.conf"
        script = f"hostname {node} && mount -t tmpfs cgroup /sys/fs/cgroup && exec slurmd -D -N {node} -f {conf}"
        log = open(self.log_dir / f"slurmd-{node}.out", "ab")
        with log:
            self.slurmd[node] = subprocess.Popen(
                self.host(node).argv("unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

    def leftovers(self) -> list[str]:
        """Processes still running in the nodes other than their slurmd: "node: pid command line"."""
        ours = {p.pid for p in self.slurmd.values()}
        return [f"{h.name}: {pid} {_cmdline(pid)}" for h in self.network.hosts for pid in sorted(h.pids())
                if pid not in ours and _cmdline(pid)]

    def traces(self) -> list[str]:
        """What of this cluster is still on the machine: namespaces, mounts, processes, files (all [] once it
        is gone)."""
        names = [h.name for h in self.network.hosts]
        left = [f"namespace {n}" for n in netns.sh("ip", "netns", "list").split() if n in names]
        with open("/proc/self/mounts") as f:
            left += [f"mount {line.strip()}" for line in f if any(n in line for n in names) or str(self.root) in line]
        left += [f"process {pid} {cmd}" for pid in _all_pids() if (cmd := _cmdline(pid))
                 and (str(self.root) in cmd or any(n in cmd for n in names))]
        left += [f"file {p}" for p in [self.root, *(Path("/etc/netns") / n for n in names)] if p.exists()]
        left += [f"link {self.network.bridge}"] if Path(f"/sys/class/net/{self.network.bridge}").exists() else []
        return left


@contextmanager
def slurm_cluster(nodes: int = 2, cpus: int = 2, memory_mb: int = 4096,
                  slurmd_timeout_s: int = 10, overrides: dict[str, str] | None = None) -> Iterator[SlurmCluster]:
    """A Slurm cluster of `nodes` nodes of `cpus` CPUs and memory_mb each, every node IDLE on entry; all of it
    (processes, namespaces, mounts, files) gone on leaving. overrides: slurm.conf's parameters over ours."""
    with ExitStack() as undo:
        root = Path(tempfile.mkdtemp(prefix="tyslurm-"))
        # Removed last, once nothing is left in the nodes that could still write there.
        undo.callback(shutil.rmtree, root, ignore_errors=True)
        net = undo.enter_context(netns.hosts(nodes))
        root.chmod(0o755)  # munged: every directory above its socket world-searchable
        dirs = {d: root / d for d in ("conf", "munge", "state", "spool", "log", "work", "run")}
        for d in dirs.values():
            d.mkdir(mode=0o755)
        names = [h.name for h in net.hosts]
        cluster = SlurmCluster(network=net, nodes=names, partition="main", preempting_partition="urgent",
                               env={"SLURM_CONF": str(dirs["conf"] / "slurm.conf")}, conf_dir=dirs["conf"],
                               log_dir=dirs["log"], work_dir=dirs["work"], root=root)
        # Stopped before the namespaces go (netns.hosts kills whatever is left in them after).
        undo.callback(_stop_all, cluster)

        for h in net.hosts:
            etc = Path("/etc/netns") / h.name
            etc.mkdir(parents=True, exist_ok=True)
            undo.callback(shutil.rmtree, etc, ignore_errors=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + f"{net.gateway} {socket.gethostname()}\n"
                                       + "".join(f"{x.addr} {x.name}\n" for x in net.hosts))

        sock = dirs["munge"] / "munge.socket"
        key = dirs["munge"] / "munge.key"
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:  # 0600, or munged refuses it
            f.write(secrets.token_bytes(1024))
        _write_conf(cluster, net, sock, cpus, memory_mb, slurmd_timeout_s, overrides)
        cluster.daemons.append(_daemon(dirs["log"] / "munged.out", "munged", "-F", f"--socket={sock}",
                                       f"--key-file={key}", f"--log-file={dirs['log'] / 'munged.log'}",
                                       f"--pid-file={dirs['run'] / 'munged.pid'}",
                                       f"--seed-file={dirs['munge'] / 'munged.seed'}"))
        cluster.wait(lambda: sock.exists() or cluster.daemons[0].poll() is not None, 10, "munged's socket")
        if cluster.daemons[0].poll() is not None:
            raise RuntimeError(f"munged exited: {(dirs['log'] / 'munged.out').read_text()}")
        cluster.daemons.append(_daemon(dirs["log"] / "slurmctld.out", "slurmctld", "-D", "-i",
                                       "-f", cluster.env["SLURM_CONF"]))
        for n in names:
            cluster.start_slurmd(n)
        cluster.wait(lambda: _ctld_answers(cluster), 15, "slurmctld to answer")
        cluster.wait_idle(20)
        yield cluster


def _write_conf(c: SlurmCluster, net: netns.Network, sock: Path, cpus: int, memory_mb: int, timeout_s: int,
                overrides: dict[str, str] | None) -> None:
    state, spool, log, run = (c.root / d for d in ("state", "spool", "log", "run"))
    conf = {
        "ClusterName": f"ty{secrets.token_hex(3)}",
        "SlurmctldHost": f"{socket.gethostname()}({net.gateway})",
        "SlurmctldPort": str(free_port()), "SlurmdPort": str(free_port()),
        "SlurmUser": "root", "SlurmdUser": "root",
        "AuthType": "auth/munge", "CredType": "cred/munge",
        # A requeued job waits cred_expire seconds before it may start again (120 by default).
        "AuthInfo": f"socket={sock},cred_expire={CRED_EXPIRE_S}",
        "StateSaveLocation": str(state), "SlurmdSpoolDir": f"{spool}/%n",
        "SlurmctldPidFile": f"{run}/slurmctld.pid", "SlurmdPidFile": f"{run}/slurmd-%n.pid",
        "SlurmctldLogFile": f"{log}/slurmctld.log", "SlurmdLogFile": f"{log}/slurmd-%n.log",
        "SlurmdParameters": "config_overrides", "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU", "SchedulerType": "sched/backfill",
        # Pending jobs looked at every 2 s (backfill) and 5 s (the main loop): a requeued job starts once eligible.
        "SchedulerParameters": "bf_interval=2,sched_interval=5",
        "MpiDefault": "none", "SwitchType": "switch/none",
        "SlurmdTimeout": str(timeout_s), "MessageTimeout": str(MESSAGE_TIMEOUT_S), "ReturnToService": "2",
        "KillWait": str(KILL_WAIT_S), "OverTimeLimit": "0", "MinJobAge": "300",
        "JobCompType": "jobcomp/filetxt", "JobCompLoc": str(c.jobcomp_log),
        "PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE",
        **(overrides or {}),
    }
    text = "".join(f"{k}={v}\n" for k, v in conf.items())
    text += "".join(f"NodeName={h.name} NodeHostname={h.name} NodeAddr={h.addr} CPUs={cpus} "
                    f"RealMemory={memory_mb} State=UNKNOWN\n" for h in net.hosts)
    text += (f"PartitionName={c.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1\n"
             f"PartitionName={c.preempting_partition} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 "
             "PreemptMode=OFF\n")
    (c.conf_dir / "slurm.conf").write_text(text)
    (c.conf_dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")


def _daemon(out: Path, *argv: str) -> subprocess.Popen:
    with open(out, "ab") as f:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)


def _ctld_answers(c: SlurmCluster) -> bool:
    if c.daemons[-1].poll() is not None:
        raise RuntimeError(f"slurmctld exited: {(c.log_dir / 'slurmctld.log').read_text()[-2000:]}")
    return c.run("scontrol", "ping", check=False, timeout=10).returncode == 0


def _stop_all(c: SlurmCluster) -> None:
    """The slurmds, then slurmctld, then munged: SIGTERM, and SIGKILL to whoever is still there 5 s later."""
    procs = [*c.slurmd.values(), *reversed(c.daemons)]
    for p in procs:
        _signal(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()
    c.slurmd.clear()


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # a session of its own: whatever it forked on this machine goes with it
    except ProcessLookupError:
        pass


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
