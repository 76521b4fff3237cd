"""`trainyard gpu-check`: a GPU host's truth in one command, one table and one exit status.

From a checkout (`make gpu-check`), from the wheel in a host's own Python, or in the image (`docker run --gpus all
IMAGE gpu-check`), unattended, in this order:
- probe: torch, its CUDA build, the devices torch and NVML see, and one kernel on cuda:0;
- cuda-tests: every CUDA-marked test (`pytest -m cuda`) of the checkout's tests/ (the image and the wheel's
  install carry a copy under sys.prefix/share/trainyard/checks);
- service: a training and then a predict job through the real service (server + a cuda:0 worker);
- nccl-one-card: two ranks on cuda:0, job processes of their own with NCCL_HOSTID set apart, against one process
  at twice the batch, with SyncBatchNorm and gradient accumulation (app/cli/gpu_depth.py);
- fused: the fused optimizer for Adam, AdamW and SGD in fp32, bf16 and fp16, clipped, and a stopped job's resume
  against the run without a stop, through the service (gpu_depth);
- eight-workers: eight workers on cuda:0 with jobs that state their memory, one more job held back by the memory
  check, NVML's view of each job's context against placement's headroom (app/cli/gpu_share.py);
- preempt: a running job preempted by one of higher priority, resumed, timed until NVML shows its memory freed;
- throughput: bench.train_throughput --quick on cuda:0 against the hand-written loops;
- per-gpu, ddp, hosts: with two or more GPUs, one job per GPU at once; a 2-device job (DDP over NCCL) against the
  same job on one GPU; (and root) a job across two hosts, network namespaces with a GPU each, NCCL over its network
  transport, against the same 2 ranks on one host.

Each check runs as a process of its own, in a session of its own, under a time limit: when the limit
passes, its whole process group (servers, workers, job processes) is stopped and the check is FAILED
"timed out after N s", so a hung driver, rendezvous or job never hangs the command nor crashes it. On CUDA the
whole command keeps within a budget (`--budget`, 480 s): each check's limit is cut to what is left of it, and a
check with too little left is skipped, saying so; a lent card's session is short. The table ends with what this
host cannot prove (two GPUs, MIG, the image ...).
This module is torch-free: the probe and the checks run in processes of their own (app/cli/gpu_steps.py).

Exit status: 0 every check that ran passed; 1 a check failed (or timed out); 2 nothing could run
(no CUDA device here). `--device cpu` runs the same checks on the CPU, to rehearse the command itself.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# Each check's time limit in seconds (`--timeout` sets one for all but the probe), in the order they run. The
# probe's covers a cold CUDA initialisation of every GPU; on one H200 the checks took: probe ~20 s, cuda-tests
# ~110, service ~10, throughput ~60 (quick), and the four deeper ones are sized for ~30-60 s each.
LIMITS = {"probe": 180, "cuda-tests": 300, "service": 120, "nccl-one-card": 150, "fused": 240, "eight-workers": 240,
          "preempt": 180, "throughput": 300, "per-gpu": 600, "ddp": 900, "hosts": 900}
CHECKS = [c for c in LIMITS if c != "probe"]
TWO_GPUS = ("per-gpu", "ddp", "hosts")
BUDGET_S = 480  # the whole command on CUDA, by default: a lent card comes for ~15 minutes
MIN_LEFT_S = 20  # a check is not started with less of the budget than this left
GRACE_S = 10  # after SIGTERM to a timed-out check's process group, before SIGKILL
SHARE = Path("share", "trainyard", "checks")  # under sys.prefix: the image's copy of tests/ and bench/
# A checkout's root: this file is app/cli/gpu_check.py there (reached as trainyard/app/cli/gpu_check.py).
CHECKOUT = Path(__file__).resolve().parents[2]
STEP = [sys.executable, "-m", "trainyard.app.cli.gpu_steps"]  # a check's process (app/cli/gpu_steps.py)
# The checks whose processes are another module's (one module per concern, each under ~300 lines).
MODULES = {"nccl-one-card": "gpu_depth", "fused": "gpu_depth", "eight-workers": "gpu_share", "preempt": "gpu_share"}


def add_commands(sub) -> None:
    g = sub.add_parser("gpu-check", help="on a GPU host: the CUDA tests, real jobs on each GPU, the throughput "
                                         "benchmark; one table (exit 0 passed, 1 a check failed, 2 nothing could run)")
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: run the same checks on the CPU (a rehearsal of the command; the CUDA tests are only "
                        "collected)")
    g.add_argument("--only", help=f"comma-separated checks to run, of {', '.join(CHECKS)} (default: all)")
    g.add_argument("--timeout", type=float, help="seconds each check may take, instead of its own limit "
                                                 "(2 to 15 minutes); the probe keeps its own")
    g.add_argument("--budget", type=float, help=f"seconds the whole command may take: each check's limit is cut to "
                                                f"what is left, and one with under {MIN_LEFT_S} s left is skipped "
                                                f"(default {BUDGET_S} on CUDA, none with --device cpu; 0: none)")
    g.add_argument("--checks-dir", type=Path, help="the folder holding tests/ and bench/ (default: this checkout, or "
                                                   "the image's copy under $VIRTUAL_ENV/share/trainyard/checks)")
    g.set_defaults(fn=cmd_gpu_check)


def cmd_gpu_check(args) -> int:
    only = set(args.only.split(",")) if args.only else set(CHECKS)
    if unknown := only - set(CHECKS):
        raise SystemExit(f"trainyard gpu-check: unknown check(s) {', '.join(sorted(unknown))}; "
                         f"the checks are {', '.join(CHECKS)}")
    checks_dir = args.checks_dir or find_checks_dir()
    # None of this shell's TRAINYARD_* settings (the image sets a data dir, a host ...): the checks start
    # services of their own, and the tests expect a clean environment, as in a checkout.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}, "PYTHONUNBUFFERED": "1"}
    if checks_dir:  # bench.* and tests.* importable by every check's processes, wherever they run
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checks_dir), env.get("PYTHONPATH")]))
    budget = args.budget if args.budget is not None else BUDGET_S if args.device == "cuda" else 0
    t0 = time.monotonic()
    deadline = t0 + budget if budget else math.inf

    ok, probed = run_check([*STEP, "probe"], LIMITS["probe"], env)  # its time counts, its limit is its own
    try:
        info = json.loads(probed) if ok else {}
    except ValueError:
        ok, info, probed = False, {}, f"the probe printed no reading: {probed[:200]}"
    rows = [("probe: torch and CUDA", "passed" if ok else "FAILED", _probe_line(info) if ok else probed)]
    n = info.get("cuda_count", 0)
    devices = ["cpu"] if args.device == "cpu" else [f"cuda:{i}" for i in range(n)]
    for check, name in plan(args.device, devices, n):
        left = deadline - time.monotonic()
        why = None if ok else "the probe failed"
        why = why or (None if devices else f"no CUDA device here ({info.get('why')})")
        why = why or (None if check in only else "not asked for (--only)")
        why = why or ("one GPU on this host" if check in TWO_GPUS and n < 2 and args.device == "cuda" else None)
        why = why or (hosts_unavailable() if check == "hosts" else None)
        why = why or (None if left >= MIN_LEFT_S else f"out of time: {max(0, left):.0f} s left of the command's budget "
                                                      f"of {budget:g} s (--budget)")
        if why:
            rows.append((name, "skipped", why))
        elif check in ("cuda-tests", "throughput") and not checks_dir:
            rows.append((name, "FAILED", "no tests/ and bench/ here: run it in a checkout or in the image, or "
                                         "name them with --checks-dir"))
        else:
            rows.append((name, *run_in_folder(check, devices, checks_dir, args, env, min(left, limit(args, check)))))
    code = 1 if any(status == "FAILED" for _, status, _ in rows) else 0 if devices else 2
    print_table(info, rows, checks_dir, code, unproven(info, args.device), time.monotonic() - t0)
    return code


def limit(args, check: str) -> float:
    return args.timeout or LIMITS[check]


def plan(device: str, devices: list[str], n: int) -> list[tuple[str, str]]:
    """Each check and its name in the table, in the order they run (the checks the table names)."""
    first = devices[0] if devices else "cuda:0"
    cpu = device == "cpu"
    return [("cuda-tests", "CUDA-marked tests (pytest -m cuda)"),
            ("service", f"a training and a predict job on {first} (service)"),
            ("nccl-one-card", f"2 ranks on {first} ({'gloo' if cpu else 'NCCL'}, NCCL_HOSTID apart) vs 1 process "
                              f"at twice the batch"),
            ("fused", "the fused optimizer: adam, adamw, sgd x fp32, bf16, fp16, clipped; a stopped job's resume "
                      "(service)"),
            ("eight-workers", f"{'2 CPU workers for 8' if cpu else '8 workers'} on {first}, jobs stating their "
                              f"memory, one more held back (service)"),
            ("preempt", f"a running job on {first} preempted, requeued, resumed (service)"),
            ("throughput", f"throughput on {first} (bench.train_throughput --quick)"),
            ("per-gpu", "one job per device at once (2 CPU workers)" if cpu
             else f"one job per GPU at once ({n} GPUs)" if n else "one job per GPU at once"),
            ("ddp", "a 2-device job (DDP) vs the same job on one device"),
            ("hosts", "a 2-host job (network namespaces, one device each) vs the same 2 ranks on one host")]


def run_in_folder(check: str, devices: list[str], checks_dir: Path | None, args, env: dict,
                  limit_s: float) -> tuple[str, str]:
    """One check in a temporary folder of its own (its services' data dirs and logs): removed when it passed,
    kept and named when it failed. (result, figures or why)."""
    tmp = tempfile.mkdtemp(prefix=f"trainyard-gpu-check-{check}-")
    passed, detail = run_check(_argv(check, devices, checks_dir, args.device), limit_s, {**env, "TMPDIR": tmp},
                               cwd=checks_dir or CHECKOUT)
    if passed:
        shutil.rmtree(tmp, ignore_errors=True)
        return "passed", detail
    return "FAILED", f"{detail} (its files: {tmp})"


def unproven(info: dict, device: str) -> list[tuple[str, str]]:
    """What this host cannot prove, and why: the last lines of the table."""
    n = info.get("cuda_count", 0) if device == "cuda" else 0
    gpus = info.get("nvml") or []
    out = []
    if n < 2:
        out += [("P2P and NVLink between GPUs", f"{n or 'no'} GPU here"),
                ("several GPUs at once (per-gpu, ddp: NCCL between cards)", f"{n or 'no'} GPU here")]
    out.append(("a job across GPU hosts (machines)", "one machine: network namespaces stand for hosts (hosts), "
                                                     "with a GPU each only on a host with two"))
    if not any(g.get("mig_parent") for g in gpus):
        out.append(("MIG instances as devices", "no GPU here is in MIG mode (NVML)"))
    if Path(sys.prefix) != Path("/opt/venv"):  # the image's environment (Dockerfile.gpu)
        out.append(("the image (Dockerfile.gpu)", f"this run is {sys.prefix}'s Python, not the image's"))
    return out


def hosts_unavailable() -> str | None:
    """Why this host cannot stand in for two (network namespaces need root and iproute2's `ip`), or None."""
    if os.geteuid() != 0:
        return "needs root, to make network namespaces as hosts"
    return None if shutil.which("ip") else "needs iproute2's ip, to make network namespaces as hosts"


def find_checks_dir() -> Path | None:
    """This checkout's root, or the copy of tests/ and bench/ the image keeps beside its environment."""
    for d in (CHECKOUT, Path(sys.prefix) / SHARE):
        if (d / "tests" / "conftest.py").is_file() and (d / "bench" / "train_throughput.py").is_file():
            return d
    return None


def cuda_test_files(checks_dir: Path) -> list[str]:
    """The test files that hold CUDA-marked tests. Only they are collected: the others may import the test
    extra (a browser driver, an S3 server ...), which the image does not carry."""
    return sorted(str(p.relative_to(checks_dir)) for p in (checks_dir / "tests").rglob("test_*.py")
                  if re.search(r"\bmark\.cuda\b", p.read_text(errors="replace")))


def _argv(check: str, devices: list[str], checks_dir: Path | None, device: str) -> list[str]:
    if check in MODULES:
        return [sys.executable, "-m", f"trainyard.app.cli.{MODULES[check]}", check, devices[0]]
    if check == "cuda-tests":
        assert checks_dir is not None, "cmd_gpu_check fails the CUDA tests without a checks dir"
        return [*STEP, "cuda-tests", device, *cuda_test_files(checks_dir)]
    if check == "throughput":
        return [*STEP, "throughput", devices[0]]
    if check == "per-gpu":
        return [*STEP, "service", *(devices if device == "cuda" else ["cpu", "cpu"])]
    if check in ("ddp", "hosts"):
        return [*STEP, check, *(devices[:2] if device == "cuda" else ["cpu", "cpu"])]
    return [*STEP, "service", devices[0]]


def run_check(argv: list[str], limit: float, env: dict, cwd: Path = CHECKOUT) -> tuple[bool, str]:
    """Run one check's process in a session of its own: (passed, its last line of output, or why it failed).
    Whatever the check started is stopped with it: at its limit, and after it exits (strays)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # Files, not pipes: a stray grandchild holding a pipe open could block the read.
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True, text=True)
        try:
            p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop(p)
            return False, f"timed out after {limit:g} s"
        except BaseException:  # Ctrl-C: the check's processes, in a session of their own, did not get it
            _stop(p)
            raise
        _signal_group(p.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        last = (out.read().strip().splitlines() or [""])[-1]
        if p.returncode == 0:
            return True, last
        tail = err.read().strip().splitlines()
        return False, last or (tail[-1] if tail else f"exited with code {p.returncode}")


def _stop(p: subprocess.Popen) -> None:
    _signal_group(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(p.pid, signal.SIGKILL)
    p.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def print_table(info: dict, rows: list[tuple[str, str, str]], checks_dir: Path | None, code: int,
                unproven_here: Sequence[tuple[str, str]] = (), took_s: float | None = None) -> None:
    print("\n| | |\n|---|---|")
    for k, v in (("GPUs", ", ".join(map(_gpu, info.get("nvml", []))) or "none (NVML)"),
                 ("driver", info.get("driver") or "-"),
                 ("torch", f"{info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}" if info else "-"),
                 ("torch.cuda.device_count()", str(info.get("cuda_count", "-"))),
                 ("python", sys.version.split()[0]), ("tests from", str(checks_dir or "-"))):
        print(f"| {k} | {_cell(v)} |")
    print("\n| check | result | figures, or why |\n|---|---|---|")
    for name, status, detail in rows:
        print(f"| {name} | {status} | {_cell(detail)} |")
    if unproven_here:
        print("\n| not proven on this host | why |\n|---|---|")
        for what, why in unproven_here:
            print(f"| {what} | {_cell(why)} |")
    checks = [status for _, status, _ in rows[1:]]  # the probe is not one of them
    print(f"\n{len(checks) - checks.count('skipped')} of {len(checks)} checks run, {checks.count('FAILED')} failed"
          + (f", {took_s:.0f} s in all" if took_s is not None else ""))
    print(f"exit status {code}: " + ("every check that ran passed", "a check failed",
                                     "nothing could run")[code])


def _gpu(g: dict) -> str:
    return (g.get("name") or f"GPU {g.get('nvml_index')}") + \
        (f" ({g['memory_total'] / 2**30:.0f} GiB)" if g.get("memory_total") else "") + \
        (f": {g['problem']}" if g.get("problem") else "")


def _probe_line(info: dict) -> str:
    return f"{info['cuda_count']} CUDA device(s)" + (f"; cuda:0 {info['names'][0]} ran a kernel" if info["names"]
                                                     else f": {info['why']}")


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", str(text).replace("|", "/"))
