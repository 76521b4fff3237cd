"""Slurm's own commands as argument lists, never a shell line with a value in it: sbatch --parsable (the batch
script holds only trainyard's own command, quoted), squeue with a fixed --format, scancel; how each final Slurm
state ends a trainyard run (ENDINGS); and what a worker an allocation started learns from its environment
(in_allocation). Every name that reaches an argument is a Slurm name (app/spec/slurm.py's SLURM_NAME), every
number a positive integer, checked here whoever gave it (a job, a project's settings, the service's). Torch-free.
"""
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from trainyard.app.core.settings import Settings
from trainyard.app.core.states import Failure
from trainyard.app.spec import SLURM_NAME

NAME_PREFIX = "trainyard-"  # an allocation's job name: trainyard-<job id>
# squeue's columns: id, state, partition, nodes, reason, then the name (last: the one field a user may fill).
SQUEUE_FORMAT = "%i|%T|%P|%N|%r|%j"
COMMAND_TIMEOUT_S = 60.0
# What sbatch is told by trainyard itself: an operator's option may not say it again.
_OURS = frozenset({"--parsable", "--job-name", "--nodes", "--ntasks-per-node", "--ntasks", "--cpus-per-task",
                   "--partition", "--account", "--qos", "--time", "--mem", "--gpus-per-node", "--output",
                   "--error", "--chdir", "--wrap", "--export", "--array", "--requeue", "--no-requeue"})
_OPTION = re.compile(r"--[a-z][a-z0-9-]*(=[^\x00-\x1f]*)?")


class Refused(ValueError):
    """A value that may not reach Slurm's arguments; the message names the field."""


class SlurmError(RuntimeError):
    """A Slurm command failed (its exit status and stderr)."""


class Ending(NamedTuple):
    """What an allocation's final Slurm state does to the trainyard run it served (docs/scaling-out.md's table)."""
    cls: Failure | None  # the run's failure class; None: requeued as a preempted run is (no attempt used)
    final: str | None    # "failed", "cancelled": the job ends so; None: the class decides (retried if retryable)
    why: str


ENDINGS: dict[str, Ending] = {
    "TIMEOUT": Ending(Failure.TIMEOUT, "failed", "reached its Slurm time limit"),
    "DEADLINE": Ending(Failure.TIMEOUT, "failed", "reached its Slurm deadline"),
    "CANCELLED": Ending(Failure.CANCELLED, "cancelled", "was cancelled in Slurm, outside trainyard (scancel)"),
    "PREEMPTED": Ending(None, None, "was preempted by Slurm"),
    "NODE_FAIL": Ending(Failure.INFRASTRUCTURE, None, "lost a node (NODE_FAIL)"),
    "BOOT_FAIL": Ending(Failure.INFRASTRUCTURE, None, "could not boot its nodes (BOOT_FAIL)"),
    "FAILED": Ending(Failure.INFRASTRUCTURE, None, "ended with its workers failed (FAILED)"),
    "OUT_OF_MEMORY": Ending(Failure.OOM, "failed", "ran out of its memory limit in Slurm (OUT_OF_MEMORY)"),
    "COMPLETED": Ending(Failure.INFRASTRUCTURE, None, "ended with its workers gone before the job did"),
    "GONE": Ending(Failure.INFRASTRUCTURE, None, "is no longer known to Slurm"),
}
FINAL = frozenset(ENDINGS) | {"SPECIAL_EXIT", "REVOKED"}


@dataclass(frozen=True)
class Ask:
    """One allocation for one job: `nodes` nodes, `tasks_per_node` workers on each (one per device)."""
    job_id: int
    nodes: int
    tasks_per_node: int
    partition: str
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    mem_mb: int | None = None  # per node
    time_limit_min: int | None = None
    account: str | None = None
    qos: str | None = None
    options: tuple[str, ...] = ()  # the operator's (operator_options)


@dataclass(frozen=True)
class Seen:
    """One allocation as squeue shows it."""
    slurm_id: str
    job_id: int
    state: str
    partition: str
    nodes: str | None
    reason: str | None


def name(value: str, field: str) -> str:
    if not isinstance(value, str) or not SLURM_NAME.fullmatch(value):
        raise Refused(f"{field}: {value!r} is not a Slurm name (letters, digits, '_', '.', '-', '+', at most 64)")
    return value


def count(value: object, field: str) -> int:
    if type(value) is not int or not 1 <= value <= 1_000_000_000:
        raise Refused(f"{field}: {value!r} is not a positive whole number")
    return value


def operator_options(text: str) -> tuple[str, ...]:
    """TRAINYARD_SLURM_SBATCH_OPTIONS as separate arguments, each "--option" or "--option=value" (a value may hold
    spaces in quotes: split as a shell would, but never given to one). A word that is not one option (sbatch
    would take it for the script, or for a short option's value) or that sets what trainyard sets is refused."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise Refused(f"TRAINYARD_SLURM_SBATCH_OPTIONS: {exc}") from None
    for w in words:
        if not _OPTION.fullmatch(w):
            raise Refused(f"TRAINYARD_SLURM_SBATCH_OPTIONS: {w!r} is not one --option or --option=value")
        if w.split("=", 1)[0] in _OURS:
            raise Refused(f"TRAINYARD_SLURM_SBATCH_OPTIONS: {w.split('=', 1)[0]} is trainyard's to set")
    return tuple(words)


def sbatch_argv(ask: Ask, out_dir: Path) -> list[str]:
    """sbatch's arguments for one allocation (the script comes on stdin: batch_script)."""
    argv = ["sbatch", "--parsable", f"--job-name={NAME_PREFIX}{count(ask.job_id, 'job')}",
            f"--nodes={count(ask.nodes, 'hosts')}", f"--ntasks-per-node={count(ask.tasks_per_node, 'devices')}",
            f"--cpus-per-task={count(ask.cpus_per_task, 'cpus_per_task')}",
            f"--partition={name(ask.partition, 'partition')}",
            f"--output={out_dir / '%j.out'}", f"--chdir={out_dir}",
            # Never requeued by Slurm under the same id (a lost node, a preemption): the allocation ends, the agent
            # ends the run as ENDINGS says and asks for a new one; trainyard keeps the count of attempts.
            "--no-requeue"]
    if ask.gpus_per_node:
        argv.append(f"--gpus-per-node={count(ask.gpus_per_node, 'gpus_per_node')}")
    if ask.mem_mb is not None:
        argv.append(f"--mem={count(ask.mem_mb, 'mem_mb')}M")
    if ask.time_limit_min is not None:
        argv.append(f"--time={count(ask.time_limit_min, 'time_limit_min')}")
    if ask.account is not None:
        argv.append(f"--account={name(ask.account, 'account')}")
    if ask.qos is not None:
        argv.append(f"--qos={name(ask.qos, 'qos')}")
    return [*argv, *ask.options]


def worker_argv(job_id: int, device: str) -> list[str]:
    """The command each task of the allocation runs: a worker bound to the job (`trainyard worker --for-job`), by
    this interpreter (the nodes share the agent's installation, as the own fleet's hosts share a release)."""
    return [sys.executable, "-m", "trainyard", "worker", "--for-job", str(count(job_id, "job")), "--device", device]


def batch_script(worker: list[str]) -> str:
    """The batch script: one worker per task on every node of the allocation (srun), nothing else."""
    return "#!/bin/sh\nexec srun --kill-on-bad-exit=0 " + shlex.join(worker) + "\n"


def _run(argv: list[str], env: dict[str, str], stdin: str | None = None) -> str:
    try:
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"{argv[0]}: {exc}") from None
    if r.returncode != 0:
        raise SlurmError(f"{argv[0]} exited {r.returncode}: {r.stderr.strip()[:500]}")
    return r.stdout


def submit(ask: Ask, out_dir: Path, env: dict[str, str]) -> str:
    """Ask Slurm for the allocation; its Slurm job id."""
    out_dir.mkdir(parents=True, exist_ok=True)
    answer = _run(sbatch_argv(ask, out_dir), env, batch_script(worker_argv(ask.job_id, "cpu" if not ask.gpus_per_node
                                                                           else "auto"))).strip()
    slurm_id = answer.split(";")[0]  # "<id>" or "<id>;<cluster>"
    if not slurm_id.isdigit():
        raise SlurmError(f"sbatch answered {answer[:200]!r}, not a job id")
    return slurm_id


def parse_squeue(text: str) -> dict[str, Seen]:
    """squeue's lines (SQUEUE_FORMAT) of trainyard's allocations, by Slurm id; other jobs' are left out."""
    seen: dict[str, Seen] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 5)
        if len(parts) != 6 or not parts[5].startswith(NAME_PREFIX) or not parts[0].isdigit():
            continue
        job = parts[5][len(NAME_PREFIX):]
        if not job.isdigit():
            continue
        nodes = parts[3] if parts[3] not in ("", "(null)") else None
        reason = parts[4].strip("()") if parts[4] not in ("", "None", "(null)") else None
        seen[parts[0]] = Seen(parts[0], int(job), parts[1].split()[0].rstrip("+"), parts[2], nodes, reason)
    return seen


def squeue(env: dict[str, str]) -> dict[str, Seen]:
    """Every trainyard allocation Slurm still knows, ended ones included (for MinJobAge after their end)."""
    return parse_squeue(_run(["squeue", "--noheader", "--states=all", f"--format={SQUEUE_FORMAT}"], env))


def scancel(slurm_id: str, env: dict[str, str]) -> None:
    if not slurm_id.isdigit():
        raise Refused(f"slurm id: {slurm_id!r} is not a number")
    _run(["scancel", slurm_id], env)


def in_allocation(settings: Settings, device: str) -> tuple[Settings, str]:
    """A bound worker's settings and device inside its allocation: the node's name as Slurm knows it, the node's
    address (a job across hosts meets there; TRAINYARD_NODE_ADDR wins), and on a GPU node the task's GPU (the
    node's tasks see all of its GPUs: task N takes cuda:N)."""
    node = os.environ.get("SLURMD_NODENAME") or settings.node
    addr = settings.node_addr or _address(node)
    if device == "auto":
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        device = f"cuda:{int(os.environ.get('SLURM_LOCALID', '0'))}" if gpus and gpus != "-1" else "cpu"
    return settings.model_copy(update={"node_name": node, "node_addr": addr}), device


def _address(node: str) -> str | None:
    """The node's own address for the other nodes (what its name resolves to there), never a loopback one."""
    try:
        _, _, addrs = socket.gethostbyname_ex(node)
    except OSError:
        return None
    return next((a for a in addrs if not a.startswith("127.")), None)
