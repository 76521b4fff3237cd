"""`trainyard gpu-check` (`make gpu-check`): one table and one exit status, whatever happens; the Python
`make` builds with; and the benchmark clocks it reports, which stop only once the GPU has done the work."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.service import ROOT
from trainyard.app.cli import gpu_check

TRAINYARD = Path(sys.executable).parent / "trainyard"  # the console script, as a GPU host runs it


def gpu_check_run(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(TRAINYARD), "gpu-check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The check table: name -> (result, figures or why)."""
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("passed", "FAILED", "skipped"):
            out[cells[0]] = (cells[1], cells[2])
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host: gpu-check runs the real checks")
def test_without_cuda_it_exits_2_with_a_table_that_says_why():
    r = gpu_check_run()
    assert r.returncode == 2, r.stdout + r.stderr
    table = rows(r.stdout)
    assert table.pop("probe: torch and CUDA")[0] == "passed"
    assert len(table) == len(gpu_check.CHECKS) == 10
    assert all(status == "skipped" and "no CUDA device here" in why for status, why in table.values()), table
    assert "| torch | " in r.stdout and "0 of 10 checks run" in r.stdout
    assert "exit status 2: nothing could run" in r.stdout
    # Its last lines: what this host cannot prove, and why.
    unproven = r.stdout.split("| not proven on this host | why |")[1]
    for what in ("P2P and NVLink between GPUs", "a job across GPU hosts", "MIG instances", "the image"):
        assert f"| {what}" in unproven, unproven


def test_the_command_keeps_within_its_budget_skipping_what_it_has_no_time_for():
    """A lent card's minutes are few: past the budget, a check is not started, and the table says so."""
    t0 = time.monotonic()
    r = gpu_check_run("--device", "cpu", "--only", "service,preempt", "--budget", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    table = rows(r.stdout)
    for name in ("a training and a predict job on cpu (service)",
                 "a running job on cpu preempted, requeued, resumed (service)"):
        status, why = table[name]
        assert status == "skipped" and why.startswith("out of time: ") and "budget of 1 s" in why, why
    assert time.monotonic() - t0 < 120  # the probe only: no service was started


@pytest.mark.slow
def test_a_check_past_its_limit_fails_in_the_table_and_leaves_nothing_running(tmp_path):
    """The service check (a real server, a worker, a training job) on the CPU, given 2 s: it is stopped with
    everything it started, and the table says so; the command exits 1, not with a traceback."""
    t0 = time.monotonic()
    r = gpu_check_run("--device", "cpu", "--only", "service", "--timeout", "3", env={"TMPDIR": str(tmp_path)})
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    status, why = rows(r.stdout)["a training and a predict job on cpu (service)"]
    assert status == "FAILED" and why.startswith("timed out after 3 s (its files: "), why
    assert "Traceback" not in r.stderr and "exit status 1: a check failed" in r.stdout
    assert took < 3 + gpu_check.GRACE_S + 60  # the probe, the limit, the grace: not the job's own time
    kept = Path(why.removeprefix("timed out after 3 s (its files: ").removesuffix(")"))
    assert kept.parent == tmp_path and list(kept.glob("service-*/data/server.out")), "its service's logs are kept"
    left = []  # processes of that service (their environment names its data dir) still running
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(tmp_path).encode() in (proc / "environ").read_bytes():
                left.append((proc / "cmdline").read_bytes().replace(b"\0", b" "))
        except OSError:
            pass
    assert not left, left


@pytest.mark.slow
def test_the_checks_run_here_on_the_cpu():
    """The command's own path (a real service, a job and a predict job, a 2-device job on two workers, the
    CUDA tests found and importable) with the CPU in place of each GPU: on a GPU host only the device differs."""
    r = gpu_check_run("--device", "cpu", "--only", "cuda-tests,service,ddp")
    assert r.returncode == 0, r.stdout + r.stderr
    table = rows(r.stdout)
    status, why = table["CUDA-marked tests (pytest -m cuda)"]
    assert status == "passed" and " collected" in why and not why.startswith("0/"), why
    status, why = table["a training and a predict job on cpu (service)"]
    assert status == "passed" and why.startswith("cpu: acc ") and "predict ok" in why, why
    status, why = table["a 2-device job (DDP) vs the same job on one device"]
    assert status == "passed" and why.startswith("2 ranks on cpu, cpu: ") and "1 device: " in why, why
    assert table["throughput on cpu (bench.train_throughput --quick)"] == ("skipped", "not asked for (--only)")
    assert "exit status 0" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="making network namespaces as hosts needs root")
def test_the_two_host_check_runs_here_on_the_cpu_and_leaves_no_host_behind():
    """Two network namespaces as hosts, one CPU worker in each, the job's ranks meeting across them (gloo in place
    of NCCL): the same weights as the same 2 ranks on one host, within float rounding, and every namespace gone
    afterwards."""
    r = gpu_check_run("--device", "cpu", "--only", "hosts")
    assert r.returncode == 0, r.stdout + r.stderr
    status, why = rows(r.stdout)["a 2-host job (network namespaces, one device each) vs the same 2 ranks on one host"]
    assert status == "passed", why
    hosts = re.match(r"ranks on cpu@([^,\s]+), cpu@([^,\s]+): ", why)
    assert hosts and hosts[1] != hosts[2], why
    # The same steps: only float rounding apart (a rank alone on a host gets both cores' threads, so its
    # reductions add in another order).
    apart = re.search(r"weights apart by (\S+) of their largest", why)
    assert apart and float(apart[1]) < 1e-5, why
    # Its own namespaces, links and bridge gone (named ty<tag>h<i>, ty<tag>v<i>, tyb<tag>: app/cli/netns.py).
    # Not the whole list before and after: other tests beside this one make and remove hosts of their own.
    tag = re.fullmatch(r"ty([0-9a-f]+)h[01]", hosts[1])
    assert tag and {hosts[1], hosts[2]} == {f"ty{tag[1]}h0", f"ty{tag[1]}h1"}, why
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not {hosts[1], hosts[2]} & set(left), left
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"ty{tag[1]}v" not in links and f"tyb{tag[1]}" not in links, links


@pytest.mark.slow  # 7 s of a pytest run: the full suite's, not the quick loop's
def test_the_cuda_tests_check_keeps_pytests_whole_report_in_its_folder(tmp_path, monkeypatch):
    """The table has room for three failures; the check's folder (kept and named when it fails) holds the
    whole report, tracebacks and durations, for whoever reads it on the GPU host afterwards."""
    from trainyard.app.cli import gpu_steps
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the check's TMPDIR, as gpu-check sets it
    passed, summary = gpu_steps.cuda_tests("cpu", "tests/worker/test_cuda_multi.py")
    assert passed, summary
    log = (tmp_path / "cuda-tests.log").read_text()
    assert "test_a_two_device_job_runs_on_two_gpus_over_nccl" in log and summary.split(" (")[0] in log


def test_make_builds_with_python_3_11_and_names_it_otherwise(tmp_path):
    """PYTHON defaults to python3.11 where it is on PATH; another version stops `make` before a venv is made,
    saying which version it needs and how to name one."""
    plan = subprocess.run(["make", "-n", f"VENV={tmp_path / 'v'}", "gpu-check"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    if shutil.which("python3.11"):
        assert f"{shutil.which('python3.11')} -m venv {tmp_path / 'v'}" in plan
    assert "pip install --quiet -e '.[worker,gpu-check]'" in plan and "trainyard gpu-check" in plan
    assert "chromium" not in plan and "apt-get" not in plan  # no browser, no root
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo Python 3.10.12 && exit 0\nexit 1\n")
    old.chmod(0o755)
    r = subprocess.run(["make", f"VENV={tmp_path / 'v'}", f"PYTHON={old}", "gpu-check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert f"trainyard needs Python 3.11; {old} is: Python 3.10.12" in r.stderr
    assert "uv python find 3.11" in r.stderr and not (tmp_path / "v").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_loops_clock_waits_for_the_gpu():
    """bench.loops times each epoch with now(): on CUDA it reads the clock only once the queued kernels
    have run. A kernel that spins ~0.1 s returns to Python in microseconds."""
    from bench import loops
    device = torch.device("cuda:0")
    torch.cuda._sleep(1000)  # a context, and the sleep kernel loaded, before the clock starts
    start = loops.now(device)
    torch.cuda._sleep(int(2e8))  # ~0.1 s at 2 GHz
    assert loops.now(device) - start > 0.05


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_loops_run_with_the_numerics_the_service_applies(tmp_path, device):
    """A hand-written loop applies the service's own switches for its spec (TF32 and cuDNN's autotuner on a GPU by
    default) and says which: a ratio measures the service, not a switch only one side had on (issue 39)."""
    import json

    from bench.cases import CASES
    from bench.loops import numerics
    from trainyard.app.spec import parse_spec
    from trainyard.worker.torch_devices import switches
    run = subprocess.run([sys.executable, "-m", "bench.loops", "iris-mlp", "tight", "1", str(tmp_path), device],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout.splitlines()[-1])["numerics"]
    spec = parse_spec(CASES["iris-mlp"])
    assert printed == numerics(switches.configure(torch.device(device), spec.train))
    if device != "cpu":
        assert "tf32 on" in printed and "cudnn_benchmark on" in printed


# -- the checks that go deeper on one card: rehearsed on the CPU (gloo for NCCL, no NVML) -----------------------

DEEPER = {"nccl-one-card": "2 ranks on cpu (gloo, NCCL_HOSTID apart) vs 1 process at twice the batch",
          "fused": "the fused optimizer: adam, adamw, sgd x fp32, bf16, fp16, clipped; a stopped job's resume "
                   "(service)",
          "eight-workers": "2 CPU workers for 8 on cpu, jobs stating their memory, one more held back (service)",
          "preempt": "a running job on cpu preempted, requeued, resumed (service)"}


@pytest.mark.slow
def test_the_deeper_checks_run_here_on_the_cpu():
    """The prepared run's new checks, each for real on the CPU: two gloo ranks as two job processes against one
    process at twice the batch; nine fused-optimizer jobs and a resume after a worker's SIGTERM; workers sharing
    a device budget with one more job held back; a preemption and its resume. Each row carries its figures."""
    t0 = time.monotonic()
    r = gpu_check_run("--device", "cpu", "--only", ",".join(DEEPER), timeout=1800)
    print(r.stdout, f"\n{time.monotonic() - t0:.0f} s")
    assert r.returncode == 0, r.stdout + r.stderr
    table = rows(r.stdout)
    status, why = table[DEEPER["nccl-one-card"]]
    apart = re.search(r"losses apart by (\S+), weights by (\S+) of their largest", why)
    assert status == "passed" and apart and float(apart[1]) < 1e-4 and float(apart[2]) < 1e-4, why
    status, why = table[DEEPER["fused"]]
    assert status == "passed" and why.startswith("9 jobs (sgd, adam, adamw x fp32, bf16, fp16; clip 1.0) fused"), why
    assert "attempts 1, runs 2" in why and "from the run without a stop" in why, why
    status, why = table[DEEPER["eight-workers"]]
    assert status == "passed" and "one more waited for memory beside an idle worker and started once" in why, why
    assert why.endswith("NVML: n/a (no NVIDIA driver)"), why
    status, why = table[DEEPER["preempt"]]
    assert status == "passed" and "requeued with attempt 0, runs 1" in why and "epochs done, step" in why, why


@pytest.mark.slow
def test_two_ranks_that_do_not_take_the_same_steps_fail_the_nccl_check(tmp_path, monkeypatch):
    """The check compares: two ranks that accumulate no batches, against one process that accumulates two, take
    other steps, and the check fails naming how far apart they ended."""
    from trainyard.app.cli import gpu_depth
    real = gpu_depth.ranks_specs

    def unlike(device):
        one, two = real(device)
        return one, {**two, "train": {**two["train"], "accumulate_steps": 1}}

    monkeypatch.setattr(gpu_depth, "ranks_specs", unlike)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    passed, line = gpu_depth.nccl_one_card("cpu")
    assert not passed and line.startswith("not the same steps: 2 ranks on cpu"), line
    weights = float(re.search(r"weights by (\S+) of", line)[1])
    assert weights > gpu_depth.RANKS_TOL, line


def test_the_fused_check_fails_a_loss_that_is_not_finite_or_an_optimizer_that_is_not_fused():
    from trainyard.app.cli.gpu_depth import fused_problems
    fine = {"applied": {"optimizer": "fused", "precision": "bf16"}, "train_loss": 2.3, "val_loss": 2.2}
    assert fused_problems({("adam", "bf16"): fine}, cuda=True) == []
    assert fused_problems({("adam", "bf16"): {**fine, "train_loss": float("nan")}}, cuda=True) == \
        ["adam/bf16 train_loss nan"]
    assert fused_problems({("sgd", "bf16"): {**fine, "applied": {"optimizer": "per-tensor", "precision": "bf16"}}},
                          cuda=True) == ["sgd/bf16 ran with the per-tensor optimizer"]
    cpu_fp16 = {**fine, "applied": {"optimizer": "fused", "precision": "fp32"}}  # the CPU's documented fallback
    assert fused_problems({("adamw", "fp16"): cpu_fp16}, cuda=False) == []
    assert fused_problems({("adamw", "fp16"): cpu_fp16}, cuda=True) == ["adamw/fp16 ran in fp32"]


def test_a_gpu_process_is_matched_to_the_worker_it_descends_from(tmp_path):
    """NVML lists job processes by pid; the eight-workers check finds each one's worker by its parents in /proc:
    here a real process tree, a worker stand-in whose child starts a grandchild."""
    from trainyard.app.cli.gpu_share import worker_of
    pidfile = tmp_path / "pid"
    parent = subprocess.Popen(["sh", "-c", f"sleep 30 & echo $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not pidfile.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert worker_of(child, {parent.pid}) == parent.pid
        assert worker_of(child, {parent.pid + 100_000}) is None
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the sleep too
        parent.wait()
