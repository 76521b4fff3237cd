"""The GPU check's steps about sharing one card through the service (app/cli/gpu_check.py runs each under a time
limit): eight workers on one card taking jobs that state their memory, with NVML's view of each job's CUDA
context against placement's headroom; a preemption of a running CUDA job, with the time until NVML shows its
memory freed. `python -m trainyard.app.cli.gpu_share CHECK DEVICE` prints its one line last and exits 0 when it
passed; on the CPU (`--device cpu`) each runs for real with fewer workers, and NVML's figures are "n/a"."""
import math
import time
from pathlib import Path

from trainyard.app.cli.gpu_depth import image_job
from trainyard.app.cli.gpu_steps import failed, main, started
from trainyard.app.core.states import JobState
from trainyard.app.fleet import nvml

GB = 1e9
STATED_GB = {"cuda": 4.0, "cpu": 0.5}  # what each job of the eight-workers check states (resources.gpu_memory_gb)
HEADROOM = 1 << 30  # placement's per-job headroom on a GPU (TRAINYARD_GPU_CONTEXT_HEADROOM_BYTES' default)
MIN_RUN_S = 2  # TRAINYARD_PREEMPT_MIN_RUN_S for the preempt check


def nvml_processes(index: int = 0) -> dict[int, int] | None:
    """pid -> bytes of GPU `index` each process holds, as NVML sees it (its CUDA context and its allocator's
    memory); None without NVML. A driver that cannot say (some virtual machines) reports 0."""
    listed = nvml.nvml_devices() or []
    if index >= len(listed) or not listed[index].get("uuid"):
        return None
    read = getattr(nvml, "compute_processes", None)  # worker/supervisor/gpu_release.py reads it
    if read is not None:
        found = read(listed[index]["uuid"])
        return None if found is None else {pid: used or 0 for pid, used in found}
    nv = nvml._nvml()  # an app/fleet/nvml.py without it: NVML, initialised once per process as app/fleet/nvml.py does
    try:
        procs = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByUUID(listed[index]["uuid"]))
    except Exception:
        return None
    return {p.pid: p.usedGpuMemory or 0 for p in procs}


def fresh_context() -> str:
    """A fresh process's CUDA context on cuda:0 as the worker measures it (worker/torch_devices/context_size.py,
    where this install has it), as a part of a line."""
    try:
        from trainyard.worker.torch_devices.context_size import context_reading
    except ImportError:
        return "a fresh process's context: not measured (no context_size here)"
    found = context_reading("cuda:0")
    if found.get("context_bytes") is None:
        return f"a fresh process's context: NVML could not tell ({found.get('how')})"
    return f"a fresh process's context {found['context_bytes'] / 2**20:.0f} MiB ({found['how']})"


def worker_of(pid: int, worker_pids: set[int]) -> int | None:
    """The worker process (of worker_pids) that pid descends from, by its parents in /proc; None if none."""
    for _ in range(8):
        if pid in worker_pids:
            return pid
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None
    return None


def context_line(svc, running: list[dict], seen: dict[int, int] | None) -> tuple[bool, str]:
    """NVML's bytes of each running job's process less its allocator's reserved memory (its last epoch's): the
    CUDA context and what lies outside the allocator, which placement's headroom must cover."""
    if seen is None:
        return True, "NVML: n/a (no NVIDIA driver)"
    with svc.client() as c:
        pids = {w["pid"]: w["id"] for w in c.get("/workers").json()}
    by_worker = {j["worker_id"]: j for j in running}
    contexts = []
    for pid, used in seen.items():
        job = by_worker.get(pids.get(worker_of(pid, set(pids)) or -1))
        if job is not None:
            contexts.append(used - ((job["latest_metrics"] or {}).get("memory_reserved") or 0))
    if len(contexts) != len(running):
        return False, f"NVML lists {len(seen)} processes on the card, {len(contexts)} of them the {len(running)} jobs'"
    worst = max(contexts)
    line = (f"NVML: {sum(seen.values()) / 2**30:.1f} GiB used by {len(seen)} processes; each job's context "
            f"(NVML less reserved) {min(contexts) / 2**20:.0f}-{worst / 2**20:.0f} MiB, {fresh_context()}, "
            f"against a headroom of {HEADROOM / 2**20:.0f} MiB")
    return worst <= HEADROOM, line


def eight_workers(device: str) -> tuple[bool, str]:
    """Workers sharing one device (a GPU's memory, or on the CPU the budget TRAINYARD_DEVICE_MEMORY_GB offers it)
    with jobs that state their memory: as many jobs at once as workers less one, the budget set to hold exactly
    them, so one more waits for memory while a worker stands idle, and starts once a job is cancelled."""
    cuda = device != "cpu"
    n = 8 if cuda else 2  # two CPU workers with jobs on a small host stand for eight on a GPU
    stated = STATED_GB["cuda" if cuda else "cpu"] * GB
    per_job = stated + (HEADROOM if cuda else 0)
    budget = n * per_job + stated / 2  # n fit, n + 1 do not
    svc = started([device] * (n + 1), env={"TRAINYARD_HEARTBEAT_S": "0.5"},
                  worker_env={"TRAINYARD_DEVICE_MEMORY_GB": f"{budget / GB:.3f}"})
    try:
        spec = {**image_job(device, epochs=10_000), "device": "cuda" if cuda else "auto",
                "resources": {"gpu_memory_gb": stated / GB}}
        # On a GPU, 245 MB of images on the device each and epochs of a second or so, not dozens a second to record.
        spec["data"]["size"] = 20_000 if cuda else spec["data"]["size"]
        ids = [svc.submit({**spec, "name": f"share-{i}"})["id"] for i in range(n)]
        t0 = time.monotonic()
        svc.wait_until(lambda: all((svc.job(i)["latest_metrics"] or {}).get("epoch") for i in ids)
                       or any(svc.job(i)["state"] not in ("queued", "running") for i in ids), 600,
                       f"{n} jobs each through an epoch")
        jobs = [svc.job(i) for i in ids]
        if why := failed(*(j for j in jobs if j["state"] != JobState.RUNNING)):
            return False, why
        ok, nvml_line = context_line(svc, jobs, nvml_processes() if cuda else None)
        one_more = svc.submit({**spec, "name": "one-more"})["id"]
        time.sleep(3)  # an idle worker polls every 20 ms: it would have claimed the job by now were there room
        held = svc.job(one_more)
        with svc.client() as c:
            idle = sum(w["state"] == "idle" for w in c.get("/workers").json())
            c.post(f"/jobs/{ids[0]}/cancel")
        if held["state"] != JobState.QUEUED or not idle:
            return False, f"job {one_more} was {held['state']} beside {n} stating jobs, {idle} worker(s) idle"
        svc.wait_until(lambda: svc.job(one_more)["state"] != JobState.QUEUED, 600, "the one more job to start")
        started_after = svc.job(one_more)["state"] == JobState.RUNNING
        with svc.client() as c:
            for i in [*ids, one_more]:
                c.post(f"/jobs/{i}/cancel")
        peak = max((j["latest_metrics"] or {}).get("memory_reserved") or 0 for j in jobs)
        line = (f"{n} jobs stating {stated / GB:g} GB each ran at once on {n} of {n + 1} workers (budget "
                f"{budget / GB:.1f} GB{', headroom 1 GiB each' if cuda else ''}; {time.monotonic() - t0:.0f} s to "
                f"an epoch each{'' if cuda else '; 2 CPU workers stand for 8'})"
                f"{f', peak reserved {peak / 2**20:.0f} MiB' if cuda else ''}; one more waited for memory beside an "
                f"idle worker and "
                f"{'started once one was cancelled' if started_after else 'did NOT start once one was cancelled'}; "
                f"{nvml_line}")
        return ok and started_after, line
    finally:
        svc.stop()


def preempt(device: str) -> tuple[bool, str]:
    """A running job preempted by a job of higher priority (TRAINYARD_PREEMPT_MIN_RUN_S=2): it checkpoints, is
    requeued without using an attempt, and resumes from its checkpoint once the other has run. Timed from the
    request: when it left the device, when NVML no longer lists its process, when the other job started."""
    cuda = device != "cpu"
    svc = started([device], env={"TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_PREEMPT_MIN_RUN_S": str(MIN_RUN_S)})
    try:
        spec = image_job(device, epochs=10_000, checkpoint_every_s=0)
        low = svc.submit(spec)["id"]
        svc.wait_until(lambda: (svc.job(low)["latest_metrics"] or {}).get("epoch")
                       or svc.job(low)["state"] not in ("queued", "running"), 600, "the job's first epoch")
        if why := failed(*[j for j in [svc.job(low)] if j["state"] != JobState.RUNNING]):
            return False, why
        with svc.client() as c:
            [worker] = c.get("/workers").json()
        own = {pid for pid in nvml_processes() or () if worker_of(pid, {worker["pid"]})} if cuda else set()
        if cuda and not own:
            return False, "NVML lists no process of the running job on the card"
        t0 = time.monotonic()
        high = svc.submit({**image_job(device), "priority": 10})["id"]
        times = watch(svc, low, high, own)
        back = svc.job(low)
        if times.get("requeued") is None or back["attempt"] != 0 or back["runs"] != 1:
            return False, (f"not requeued without an attempt: {back['state']}, attempt {back['attempt']}, "
                           f"runs {back['runs']}")
        if why := failed(svc.wait_state(high, timeout=600)):
            return False, why
        svc.wait_until(lambda: "resumed from checkpoint" in svc.client().get(f"/jobs/{low}/logs").text
                       or svc.job(low)["state"] not in ("queued", "running"), 600, "the preempted job to resume")
        again = svc.job(low)
        with svc.client() as c:
            log = c.get(f"/jobs/{low}/logs").text.splitlines()
            c.post(f"/jobs/{low}/cancel")
        resumed = [ln for ln in log if "resumed from checkpoint" in ln]
        # The worker's own wait for NVML (worker/supervisor/gpu_release.py), where this install has it.
        waited = [ln.split("device memory ", 1)[1] for ln in log if "device memory " in ln and " after the job" in ln]
        if again["state"] != JobState.RUNNING or again["runs"] != 2 or not resumed:
            return False, f"the preempted job did not resume: {again['state']}, runs {again['runs']}"
        freed, requeued = times.get("freed"), times["requeued"]
        line = (f"preempted {requeued - t0:.1f} s after a job of higher priority came (min run {MIN_RUN_S} s), "
                f"requeued with attempt 0, runs 1; "
                + (f"NVML showed its memory freed {freed - requeued:+.2f} s from the requeue, "
                   if freed is not None else "NVML: n/a, " if not cuda else "NVML still listed its process, ")
                + (f"its worker's log: {waited[0]}, " if waited else "")
                + f"the other job started {times.get('high', math.nan) - requeued:+.2f} s from the requeue; then "
                f"{resumed[0].split('resumed from checkpoint: ')[-1]}")
        return not cuda or freed is not None, line
    finally:
        svc.stop()


def watch(svc, low: int, high: int, pids: set[int]) -> dict[str, float]:
    """When (time.monotonic()) the low job was seen requeued, NVML stopped listing every process of pids (the
    card's before the preemption), and the high job was seen running; polled every 20 ms for up to 120 s."""
    times: dict[str, float] = {}
    deadline = time.monotonic() + 120
    with svc.client() as c:
        while time.monotonic() < deadline and len(times) < (3 if pids else 2):
            now = time.monotonic()
            if "requeued" not in times and c.get(f"/jobs/{low}").json()["state"] == JobState.QUEUED:
                times["requeued"] = now
            if "high" not in times and c.get(f"/jobs/{high}").json()["state"] != JobState.QUEUED:
                times["high"] = now
            if pids and "freed" not in times and not pids & set(nvml_processes() or ()):
                times["freed"] = now
            time.sleep(0.02)
    return times


STEPS = {"eight-workers": eight_workers, "preempt": preempt}

if __name__ == "__main__":
    main(STEPS)
