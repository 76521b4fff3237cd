"""The GPU check's steps that go into the training loop on one card (app/cli/gpu_check.py runs each under a time
limit): NCCL between two processes on one GPU against one process at twice the batch, and the fused optimizer in
each precision with a resume against the uninterrupted run. `python -m trainyard.app.cli.gpu_depth CHECK DEVICE`
prints its one line last and exits 0 when it passed; on the CPU (`--device cpu`) each runs for real, gloo in
place of NCCL."""
import math
import multiprocessing as mp
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from trainyard.app.cli.gpu_steps import artifact, failed, main, started, weights_apart
from trainyard.app.core.ports import free_port
from trainyard.app.core.states import JobState

PER_RANK = 32  # each rank's batch; the single process takes twice it
RANKS_TOL = 1e-3  # losses and weights, relative: the same steps in another order of float sums (cuDNN's kernels)
RESUME_TOL = 1e-5  # a deterministic job resumed: bit for bit is expected, this is the most the check forgives
OPTIMIZERS: dict[str, dict[str, Any]] = {"sgd": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
                                         "adam": {"optimizer": "adam", "lr": 1e-3},
                                         "adamw": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01}}
PRECISIONS = ("fp32", "bf16", "fp16")
TERMINAL = ("done", "error", "preempted")


def image_job(device: str, **train) -> dict:
    """A small conv net with batch norm on fake images: 32x32 on a GPU, 16x16 and fewer on the CPU."""
    cuda = device != "cpu"
    return {"kind": "train", "device": "cuda" if cuda else "cpu",
            "model": {"arch": "cnn", "channels": [16, 32]},
            "data": {"dataset": "fake", "image_size": [3, 32, 32] if cuda else [3, 16, 16], "num_classes": 10,
                     "size": 2048 if cuda else 320},
            "train": {"epochs": 2, "batch_size": 64, **train}}


# -- nccl-one-card -------------------------------------------------------------------------------------------


def ranks_specs(device: str) -> tuple[dict, dict]:
    """One process at twice the batch, and two ranks at the batch, both accumulating 2 batches a step. SGD: its
    step is linear in the gradient, so float rounding stays rounding (Adam's normalised step would amplify it
    where a gradient is near zero). On the CPU no batch norm: SyncBatchNorm is CUDA's, and gloo ranks' own
    batch norms would see half the batch each."""
    base = image_job(device, optimizer="sgd", lr=0.05, momentum=0.9, accumulate_steps=2, tf32=False,
                     checkpoint_every=0)
    base["model"]["batch_norm"] = device != "cpu"
    one = {**base, "train": {**base["train"], "batch_size": 2 * PER_RANK}}
    two = {**base, "train": {**base["train"], "batch_size": PER_RANK}, "devices": 2, "hosts": 2}
    return one, two


class JobProcess:
    """A job process as its worker starts one (runner.run in a process of its own), its events on a pipe."""

    def __init__(self, plan, env: dict[str, str] | None = None):
        from trainyard.worker import runner
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=runner.run, args=(plan, child))
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})  # a spawned process starts with this process's environment
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        child.close()
        self.events: list[dict] = []

    def finish(self, timeout: float = 3600) -> dict:
        while not self.events or self.events[-1]["type"] not in TERMINAL:
            if not self.conn.poll(timeout):
                raise TimeoutError(f"no event from the job process in {timeout:g} s")
            self.events.append(self.conn.recv())
        self.proc.join(30)
        return self.events[-1]

    def epochs(self) -> list[dict]:
        return [e for e in self.events if e["type"] == "epoch"]


def plan_for(root: Path, name: str, spec: dict, device: str, **more):
    from trainyard.app.records import Job
    from trainyard.worker.supervisor.plan import JobPlan
    run_dir, ck = root / name / "art", root / name / "ck"
    run_dir.mkdir(parents=True)
    ck.mkdir(parents=True)
    fields: dict[str, Any] = {**{f: None for f in Job.__dataclass_fields__}, "id": 1, "kind": "train",
                              "state": JobState.RUNNING, "spec": spec, "attempt": 1, "claim": 1, "errors": []}
    job = Job(**fields)
    return JobPlan(job=job, device=device, data_dir=root, run_dir=run_dir, checkpoint_stem=ck / "run-1.pt",
                   threads=1 if device == "cpu" else None, **more)


def nccl_one_card(device: str) -> tuple[bool, str]:
    """Two ranks on one device, each a job process of its own meeting at rank 0's address (the worker's path for a
    job across hosts), NCCL_HOSTID set apart: NCCL refuses two ranks on one GPU of one host, and takes these for
    two hosts talking over its network transport. Against one process at twice the per-rank batch: the same
    steps, so the same losses and weights within RANKS_TOL. Not through the service: its placement never puts two
    ranks of a job on one GPU (they would only contend for it)."""
    from safetensors.torch import load_file
    one, two = ranks_specs(device)
    root = Path(tempfile.mkdtemp(prefix="ranks-"))
    master = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    single = JobProcess(plan_for(root, "one", one, device))
    pair = [JobProcess(plan_for(root, f"rank{r}", two, device, ranks=(device, device), master=master,
                                local_ranks=(r,)), env={"NCCL_HOSTID": f"gpu-check-rank{r}"}) for r in (0, 1)]
    ends = [p.finish() for p in (single, *pair)]
    took = time.monotonic() - t0
    if bad := [e for e in ends if e["type"] != "done"]:
        return False, f"a run ended {bad[0]['type']}: {bad[0].get('error', {}).get('message', '')[:300]}"
    if ends[1]["result"]["devices"] != 2:
        return False, f"rank 0 reports {ends[1]['result']['devices']} devices, not 2"
    a, b = single.epochs(), pair[0].epochs()
    losses = max((relative(x[k], y[k]) for x, y in zip(a, b) for k in ("train_loss", "val_loss")), default=math.inf)
    if len(a) != len(b) or not a:
        losses = math.inf
    weights = weights_apart(*(load_file(root / n / "art" / "model.safetensors") for n in ("one", "rank0")))
    how = ("NCCL, SyncBatchNorm" if device != "cpu" else "gloo, no batch norm (SyncBatchNorm is CUDA's)")
    line = (f"2 ranks on {device} ({how}), batch {PER_RANK} each, vs 1 process at {2 * PER_RANK}, accumulating 2: "
            f"losses apart by {losses:.1e}, weights by {weights:.1e} of their largest (at most {RANKS_TOL:g}); "
            f"{len(a)} epochs, {took:.1f} s")
    ok = losses <= RANKS_TOL and weights <= RANKS_TOL
    return ok, line if ok else f"not the same steps: {line}"


def relative(x: float | None, y: float | None) -> float:
    """|x - y| over |x| (inf when either is missing or not finite)."""
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
        return math.inf
    return abs(x - y) / max(abs(x), 1e-12)


# -- fused ---------------------------------------------------------------------------------------------------


def fused_problems(results: dict[tuple[str, str], dict], cuda: bool) -> list[str]:
    """What is wrong with the fused optimizer's jobs' results, by (optimizer, precision): not fused, not the
    precision asked for (fp16 falls back to fp32 on the CPU only), a loss that is not finite."""
    out = []
    for (opt, prec), r in results.items():
        applied = r.get("applied") or {}
        if applied.get("optimizer") != "fused":
            out.append(f"{opt}/{prec} ran with the {applied.get('optimizer')} optimizer")
        if applied.get("precision") != prec and (cuda or prec != "fp16"):
            out.append(f"{opt}/{prec} ran in {applied.get('precision')}")
        for k in ("train_loss", "val_loss"):
            if not isinstance(r.get(k), float) or not math.isfinite(r[k]):
                out.append(f"{opt}/{prec} {k} {r.get(k)}")
    return out


def fused(device: str) -> tuple[bool, str]:
    """Adam, AdamW and SGD in fp32, bf16 and fp16, gradients clipped, through the service: each reports the fused
    optimizer, its precision and finite losses. Then an AdamW job (fp16 on a GPU: its GradScaler; bf16 on the
    CPU), deterministic, whose worker is stopped (SIGTERM) mid-run: it checkpoints, is requeued without using an
    attempt, and the other worker resumes it, to the weights of the same job run without a stop."""
    cuda = device != "cpu"
    svc = started([device, device], env={"TRAINYARD_HEARTBEAT_S": "0.5"})
    try:
        t0 = time.monotonic()
        ids = {(o, p): svc.submit(image_job(device, grad_clip_norm=1.0, precision=p, **OPTIMIZERS[o]))["id"]
               for o in OPTIMIZERS for p in PRECISIONS}
        jobs = {k: svc.wait_state(i, timeout=3600) for k, i in ids.items()}
        if why := failed(*jobs.values()):
            return False, why
        with svc.client() as c:
            results = {k: c.get(f"/jobs/{j['id']}/result").json() for k, j in jobs.items()}
        if problems := fused_problems(results, cuda):
            return False, "; ".join(problems[:4])
        finals = [r["train_loss"] for r in results.values()]
        line = (f"{len(results)} jobs (sgd, adam, adamw x fp32, bf16, fp16; clip 1.0) fused, final train losses "
                f"{min(finals):.3f}-{max(finals):.3f}{'' if cuda else ' (fp16 ran as fp32 on the cpu)'}, "
                f"{time.monotonic() - t0:.0f} s")
        ok, resumed = stopped_and_resumed(svc, device)
        return ok, f"{line}; {resumed}"
    finally:
        svc.stop()


def stopped_and_resumed(svc, device: str) -> tuple[bool, str]:
    cuda = device != "cpu"
    spec = image_job(device, grad_clip_norm=1.0, precision="fp16" if cuda else "bf16", deterministic=True,
                     checkpoint_every_s=0, epochs=24 if cuda else 10, batch_size=16, **OPTIMIZERS["adamw"])
    whole = svc.wait_state(svc.submit(spec)["id"], timeout=3600)
    job_id = svc.submit(spec)["id"]
    svc.wait_until(lambda: (svc.job(job_id)["latest_metrics"] or {}).get("epoch", 0) >= 1
                   or svc.job(job_id)["state"] in ("succeeded", "failed"), 600, "the job's first epoch")
    running = svc.job(job_id)
    if running["state"] != JobState.RUNNING:
        return False, f"the job to stop was {running['state']} before its worker was stopped"
    with svc.client() as c:
        pid = next(w["pid"] for w in c.get("/workers").json() if w["id"] == running["worker_id"])
    os.kill(pid, signal.SIGTERM)
    done = svc.wait_state(job_id, timeout=3600)
    if why := failed(whole, done):
        return False, why
    at = (done["result"].get("resumed_from_epoch"), done["result"].get("resumed_from_step"))
    if at[0] is None or done["runs"] != 2 or done["attempt"] != 1:
        return False, (f"the stopped job did not resume as it should: resumed from {at}, runs {done['runs']}, "
                       f"attempts {done['attempt']}")
    apart = weights_apart(artifact(svc, whole["id"]), artifact(svc, job_id))
    how = "bit for bit" if apart == 0 else f"apart by {apart:.1e} of the largest weight"
    line = (f"resumed ({spec['train']['precision']}, adamw, deterministic) after its worker's SIGTERM at epoch "
            f"{at[0]}, step {at[1]}, attempts 1, runs 2: {how} from the run without a stop")
    return apart <= RESUME_TOL, line if apart <= RESUME_TOL else f"the resumed run differs: {line}"


STEPS = {"nccl-one-card": nccl_one_card, "fused": fused}

if __name__ == "__main__":
    main(STEPS)
