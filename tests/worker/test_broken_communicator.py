"""A broken communicator on one host is the run's trouble, not the job's (issue 39, finding 2): the collective's own
error (NCCL's ncclRemoteError, an aborted communicator, gloo's closed connection) is `infrastructure` and retried as
across hosts; a rank that breaks the link reports why; a device that fails under a lent rank takes the worker that
lent it out of service, not the one that claimed the job."""
import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers.service import ROOT, Service, probe_plugin, run_job
from trainyard.app.core.states import JobState
from trainyard.app.records import Job
from trainyard.worker import broken_links, distributed, runner
from trainyard.worker.supervisor.plan import JobPlan

RECORDED = json.loads((ROOT / "tests" / "fixtures" / "gpu" / "cuda_failures_h200.json").read_text())
# What rank 0 of two on an H200 printed when rank 1 exited under an all_reduce (NCCL 2.28.9): the fixture keeps the
# tail of its output (the watchdog's frames); the head is the words NCCL and torch print for it, as in the pinned
# stack's libnccl.so ("remote process exited or there was a network error") and libtorch_cuda.so (the rest).
NCCL_PEER_EXITED = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: NCCL error: "
    "remote process exited or there was a network error, NCCL version 2.28.9\n"
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.\n"
    "Last error:\nsocketProgress: Connection closed by remote peer\n"
    "Exception raised from checkForNCCLErrorsInternal at /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:405 "
    "(most recent call first):\nframe #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, "
    "std::char_traits<char>, std::allocator<char> " + RECORDED["nccl_peer_exited"]["rank0_output_tail"])
# gloo on this CPU (torch 2.14.1), rank 0's all_reduce after rank 1 left the group: a plain RuntimeError.
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                    "[127.0.0.1]:8324. This is typically caused by a remote worker crashing. Check the logs of the "
                    "remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
# A CUDA error only a failing card raises, in the words torch used for the device-side assert an H200 raised.
ECC = RECORDED["device_assert"]["stderr_tail"].split("Error: ", 1)[1] \
    .replace("device-side assert triggered", "uncorrectable ECC error encountered") \
    .replace("cudaErrorAssert", "cudaErrorECCUncorrectable")


# ---- which errors are a broken link -------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [
    dist.DistBackendError(NCCL_PEER_EXITED),   # how torch raises it where it raises (not the watchdog's abort)
    RuntimeError(NCCL_PEER_EXITED),
    dist.DistBackendError("NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version "
                          "2.28.9\nncclSystemError: System call (e.g. socket, malloc) or external library call failed "
                          "or device error. \nLast error:\nsocket.c:483 NCCL WARN socketPollConnect: Connection reset"),
    dist.DistBackendError("NCCL error: internal error - please report this issue to the NCCL developers, NCCL version "
                          "2.28.9\nncclInternalError: Internal check failed."),
    RuntimeError("NCCL communicator was aborted on rank 1."),
    dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                          "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."),
    dist.DistNetworkError("Connection reset by peer"),   # the store's, by type
    dist.DistStoreError("Socket Timeout"),
    RuntimeError(GLOO_PEER_CLOSED),
], ids=["nccl-remote", "nccl-remote-plain", "nccl-system", "nccl-internal", "aborted", "watchdog-timeout",
        "store-network", "store-timeout", "gloo-closed"])
def test_the_errors_of_a_lost_peer_or_link_are_a_broken_link(exc):
    assert broken_links.is_broken_link(exc)


@pytest.mark.parametrize("exc", [
    dist.DistBackendError("NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9\n"
                          "ncclInvalidUsage: This usually reflects invalid usage of NCCL library."),
    dist.DistBackendError("NCCL error: invalid argument, NCCL version 2.28.9\nncclInvalidArgument: Invalid value for "
                          "an argument."),
    dist.DistBackendError("NCCL error: unhandled cuda error, NCCL version 2.28.9\nncclUnhandledCudaError: Call to "
                          "CUDA function failed.\nLast error:\nCuda failure 'an illegal memory access was "
                          "encountered'"),
    RuntimeError("my loader: Connection closed by peer"),   # a job's own words, not gloo's transport
    RuntimeError("Timed out waiting for the dataset lock"),
    ValueError(GLOO_PEER_CLOSED),
], ids=["nccl-misuse", "nccl-argument", "nccl-cuda", "job-words", "job-timeout", "not-a-runtime-error"])
def test_the_jobs_own_errors_and_nccls_misuse_are_not(exc):
    assert not broken_links.aborted_by_watchdog(str(exc))
    assert not broken_links.is_broken_link(exc)


def test_rank_0_aborted_by_nccls_watchdog_is_known_by_what_it_printed():
    # The H200's recording keeps only the watchdog's frames (the abort's last words): they suffice.
    assert broken_links.aborted_by_watchdog(RECORDED["nccl_peer_exited"]["rank0_output_tail"])
    assert broken_links.aborted_by_watchdog(NCCL_PEER_EXITED)
    assert not broken_links.aborted_by_watchdog('Fatal Python error: Aborted\n\nCurrent thread 0x7f (most recent '
                                                'call first):\n  File "train.py", line 3 in <module>')


def job(spec: dict, attempt: int = 1) -> Job:
    blank = {name: None for name in Job.__dataclass_fields__}
    return Job(**{**blank, "id": 1, "kind": spec["kind"], "state": JobState.RUNNING, "spec": spec,
                  "attempt": attempt, "claim": attempt, "errors": []})


def plan_of(tmp_path: Path, spec: dict, ranks: int, master: str = "") -> JobPlan:
    (tmp_path / "art").mkdir(exist_ok=True)
    (tmp_path / "ck").mkdir(exist_ok=True)
    return JobPlan(job=job(spec), device="cpu", data_dir=tmp_path, run_dir=tmp_path / "art",
                   checkpoint_stem=tmp_path / "ck" / "run-1.pt", ranks=("cpu",) * ranks, master=master, threads=1)


def ending(tmp_path: Path, exc: Exception, rank: int = 0, size: int = 2, master: str = "") -> dict:
    plan = plan_of(tmp_path, {**run_job("x"), "devices": size}, size, master)
    where = runner._Placement("cpu", world=distributed.World(rank, size))
    try:
        raise exc
    except Exception as raised:
        return runner._ending(raised, plan, where)["error"]


@pytest.mark.parametrize("master", ["", "127.0.0.1:29500"], ids=["one-host", "across-hosts"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_broken_communicator_is_infrastructure_on_one_host_as_across_hosts(tmp_path, master, rank):
    error = ending(tmp_path, dist.DistBackendError(NCCL_PEER_EXITED), rank, master=master)
    assert (error["class"], error["type"], error["rank"]) == ("infrastructure", "RankLost", rank), error
    gone = "a host's ranks or its network" if master else "another rank's process or its link"
    assert error["message"] == (f"rank {rank} lost its link to the job's other ranks ({gone} went away): "
                                f"DistBackendError: {NCCL_PEER_EXITED.splitlines()[0]}")
    assert ending(tmp_path, RuntimeError(GLOO_PEER_CLOSED), rank, master=master)["class"] == "infrastructure"


@pytest.mark.parametrize("master", ["", "127.0.0.1:29500"], ids=["one-host", "across-hosts"])
def test_nccls_misuse_stays_the_jobs_and_a_job_on_one_device_has_no_link_to_lose(tmp_path, master):
    misuse = dist.DistBackendError("NCCL error: invalid usage, NCCL version 2.28.9\nncclInvalidUsage: This usually "
                                   "reflects invalid usage of NCCL library.")
    assert ending(tmp_path, misuse, master=master)["class"] == "job"
    assert ending(tmp_path, dist.DistBackendError(NCCL_PEER_EXITED), size=1)["class"] == "job"


# ---- real ranks: who reports a broken link ------------------------------------------------------------------

ENTRYPOINTS = f'''
import os
import sys
import time

import torch
import torch.distributed as dist

ECC = {ECC!r}
WATCHDOG = {NCCL_PEER_EXITED!r}


def leave(ctx):
    # Its links to the other ranks close (as an aborted NCCL communicator's do) while its process lives on: what
    # the others see first is their collective's own error, not a rank that died.
    dist.destroy_process_group()


def link_lost_once(ctx, config):
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank is in
    if ctx.attempt == 1 and ctx.rank == 1:
        leave(ctx)
        time.sleep(300)
    dist.all_reduce(t)
    return {{"attempt": ctx.attempt, "sum": t.item()}}


def breaks_then_fails(ctx, config):
    dist.barrier()
    if ctx.rank == 2:  # it breaks the link, then fails of its own error a moment later
        leave(ctx)
        time.sleep(0.5)
        raise ValueError("rank 2's own error")
    dist.all_reduce(torch.ones(1))
    return {{}}


def aborted(ctx, config):
    dist.barrier()
    if ctx.rank == 1:  # as NCCL's watchdog ends a rank whose communicator broke (SIGABRT)
        os.abort()
    dist.all_reduce(torch.ones(1))
    return {{}}


def rank_0_aborted_by_the_watchdog_once(ctx, config):
    dist.barrier()
    if ctx.attempt == 1 and ctx.rank == 0:  # what NCCL's watchdog prints as it aborts rank 0, on an H200
        print(WATCHDOG, file=sys.stderr, flush=True)
        os.abort()
    dist.barrier()
    return {{"attempt": ctx.attempt}}


def device_fails_on_rank_1(ctx, config):
    dist.barrier()
    if ctx.attempt == 1 and ctx.rank == 1:
        raise torch.AcceleratorError(ECC)
    dist.barrier()
    return {{"attempt": ctx.attempt, "rank": ctx.rank}}
'''
NAMES = ("link_lost_once", "breaks_then_fails", "aborted", "rank_0_aborted_by_the_watchdog_once",
         "device_fails_on_rank_1")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    return probe_plugin(tmp_path_factory.mktemp("links"), "trainyard_broken_links", ENTRYPOINTS, NAMES)


def final_event(tmp_path: Path, entrypoint: str, ranks: int, timeout: float = 60) -> dict:
    """A run job on `ranks` CPU ranks in a job process of its own, as its supervisor starts it: its last event."""
    ctx = mp.get_context("spawn")
    events, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=runner.run, args=(plan_of(tmp_path, {**run_job(entrypoint), "devices": ranks}, ranks),
                                                child))
    proc.start()
    child.close()
    try:
        while True:
            assert events.poll(timeout), f"no event from {entrypoint} in {timeout} s"
            event = events.recv()
            if event["type"] in ("done", "error", "preempted"):
                return event
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_the_rank_that_broke_the_link_reports_why_not_the_ranks_that_lost_it(tmp_path, plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin))
    t0 = time.monotonic()
    final = final_event(tmp_path, "breaks_then_fails", 3)
    assert final["type"] == "error", final
    error = final["error"]
    assert (error["class"], error["type"], error["rank"]) == ("job", "ValueError", 2), error
    assert error["message"] == "rank 2: rank 2's own error"
    assert time.monotonic() - t0 < 60


def test_a_rank_aborted_as_nccls_watchdog_aborts_one_is_named_and_retried(tmp_path, plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin))
    error = final_event(tmp_path, "aborted", 2)["error"]
    assert (error["class"], error["type"], error["rank"]) == ("infrastructure", "RankLost", 1), error
    assert error["message"].startswith("rank 1: pid ") and "signal 6 (Aborted)" in error["message"], error


# ---- through the service: retried, and the lent worker out of service --------------------------------------

@pytest.fixture
def two_workers(tmp_path, plugin):
    svc = Service(tmp_path / "data")
    svc.start_server()
    env = {"PYTHONPATH": f"{ROOT}:{plugin}"}
    try:
        svc.start_worker("cpu", env=env)
        svc.start_worker("cpu", env=env)
        yield svc, env
    finally:
        svc.stop()


def workers(svc: Service) -> dict[str, dict]:
    with svc.client() as c:
        return {w["id"]: w for w in c.get("/workers").json()}


@pytest.mark.slow
def test_a_communicator_broken_under_a_one_host_job_is_retried_and_the_job_succeeds(two_workers):
    svc, _ = two_workers
    job = svc.submit({**run_job("link_lost_once"), "devices": 2})
    done = svc.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded", (done["errors"], svc.output())
    assert done["runs"] == 2 and done["result"] == {"attempt": 2, "sum": 4.0}
    [lost] = done["errors"]
    assert (lost["class"], lost["type"], lost["rank"], lost["attempt"]) == ("infrastructure", "RankLost", 0, 1), lost
    assert lost["message"].startswith("rank 0 lost its link to the job's other ranks (another rank's process or its "
                                      "link went away): RuntimeError: "), lost
    assert "gloo/transport/" in lost["message"]  # a closed or reset connection, as gloo's transport saw it
    # A broken link says nothing about a device: both workers stay in service.
    assert all(w["state"] != "unavailable" and not w["unavailable"] for w in workers(svc).values())
    # Rank 0 itself aborted by NCCL's watchdog (what a broken communicator does to one host's ranks: no exception,
    # a SIGABRT) is the same trouble: retried, not the job's crash.
    job = svc.submit({**run_job("rank_0_aborted_by_the_watchdog_once"), "devices": 2})
    done = svc.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded" and done["result"] == {"attempt": 2}, (done["errors"], svc.output())
    [lost] = done["errors"]
    assert (lost["class"], lost["type"]) == ("infrastructure", "RankLost"), lost
    assert "NCCL's watchdog" in lost["message"], lost


@pytest.mark.slow
def test_a_device_that_fails_under_a_lent_rank_takes_its_worker_out_of_service_not_the_claimers(two_workers):
    svc, env = two_workers
    job = svc.submit({**run_job("device_fails_on_rank_1"), "devices": 2})
    svc.wait_until(lambda: svc.job(job["id"])["errors"], 120, "the first run to fail")
    failed = svc.job(job["id"])
    claimer, lender = (r["worker"] for r in failed["ranks"])
    [error] = failed["errors"]
    assert (error["class"], error["type"], error["rank"]) == ("infrastructure", "DeviceFailure", 1), error
    assert error["message"].startswith("rank 1: device cpu failed: AcceleratorError: CUDA error: uncorrectable ECC")
    svc.wait_until(lambda: workers(svc)[lender]["state"] == "unavailable", 10, "the lent worker out of service")
    why = workers(svc)[lender]["unavailable"]
    assert why == f"{error['message']} (under job {job['id']}); restart the worker once the device works again"
    # Its own process heartbeats on (a few beats of 0.5 s) and stays out: it learnt, it does not undo it.
    time.sleep(2.0)
    listed = workers(svc)
    assert listed[lender]["state"] == "unavailable" and listed[lender]["unavailable"] == why
    assert listed[lender]["last_heartbeat_age_s"] < 3  # alive: heartbeating, not lost
    assert listed[claimer]["state"] != "unavailable" and not listed[claimer]["unavailable"]
    assert svc.job(job["id"])["state"] == "queued"  # two devices wanted, one worker left in service
    # Another worker comes: the retry runs on it and the claimer, never on the worker out of service.
    svc.start_worker("cpu", env=env)
    done = svc.wait_state(job["id"], timeout=240)
    assert done["state"] == "succeeded" and done["runs"] == 2, (done["errors"], svc.output())
    assert lender not in {r["worker"] for r in done["ranks"]}
    assert workers(svc)[lender]["state"] == "unavailable"
