"""What a `run` job costs over calling the same function yourself: the example plugin's `cifar_loop`
entrypoint (examples/plugin) as a run job, against `cifar_loop(Context.local(config), config)` in
this process, side by side in one run, same config, same seed, same number of torch threads.

Run: `.venv/bin/python -m bench.run_overhead [--rounds 3]` from the repository root (needs the
example plugin installed: `make setup` does it).

Cases (FakeData 3x32x32 images, the tutorial's Net and SGD; every epoch reports and checkpoints):
1. `start`: 1 epoch of 20 images, one batch: almost nothing but starting and finishing. Direct: the
   call. Run job: POST -> succeeded by the database's clock (created_at -> finished_at), split into
   submit -> running (the claim) and running -> succeeded (fork, the plugin's import, the call, the
   artifact, the result).
2. `epochs`: 200 epochs of 20 images: each epoch one step, one evaluation, one report and one
   checkpoint. Per-epoch cost = (epochs - start) / 199, for each side; the difference is what an
   epoch's report and checkpoint cost a run job beyond a local run (the pipe to the supervisor, its
   database writes, fenced).
3. `work`: 3 epochs of 3000 images, batch 20: a small but real loop.

Each case runs `--rounds` times on each side, alternating, after one warm-up of each (the direct
side's first call imports torchvision and the plugin; the run job's process does that every time,
which counts as start). Medians are shown. One CPU worker, whose job process gets the host's cores
as torch threads; the direct side sets the same number.
"""
import argparse
import contextlib
import io
import os
import statistics
import time

import torch

from bench.common import env_line, iso_s, load_note, service, table
from trainyard import Context
from trainyard.app.core.states import JobState

CASES = {
    "start": {"epochs": 1, "size": 20, "batch_size": 20},
    "epochs": {"epochs": 200, "size": 20, "batch_size": 20},
    "work": {"epochs": 3, "size": 3000, "batch_size": 20},
}


def direct(config: dict) -> float:
    from trainyard_example.cifar import cifar_loop
    ctx = Context.local(config)
    with contextlib.redirect_stderr(io.StringIO()):  # Context.local prints each report
        t0 = time.perf_counter()
        cifar_loop(ctx, dict(config))
        return time.perf_counter() - t0


def as_job(svc, c, config: dict) -> dict:
    job = c.post("/jobs", json={"kind": "run", "entrypoint": "cifar_loop", "device": "cpu", "config": config})
    job = job.raise_for_status().json()
    while job["state"] not in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        time.sleep(0.2)  # the times come from the database; polling slowly keeps the server off the cores
        job = c.get(f"/jobs/{job['id']}").raise_for_status().json()
    if job["state"] != JobState.SUCCEEDED:
        raise RuntimeError(f"job {job['id']} {job['state']}: {job['error']}\n{svc.output()}")
    created, started, finished = (iso_s(job[k]) for k in ("created_at", "started_at", "finished_at"))
    return {"total": finished - created, "claim": started - created, "run": finished - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)  # what a lone CPU worker gives its job process

    results: dict[str, dict[str, list]] = {name: {"direct": [], "job": []} for name in CASES}
    with service(workers=1) as svc, svc.client() as c:
        direct(CASES["start"])
        as_job(svc, c, CASES["start"])
        for _ in range(args.rounds):
            for name, config in CASES.items():
                results[name]["direct"].append(direct(config))
                results[name]["job"].append(as_job(svc, c, config))

    med = {name: {"direct": statistics.median(r["direct"]),
                  **{k: statistics.median(j[k] for j in r["job"]) for k in ("total", "claim", "run")}}
           for name, r in results.items()}
    rows = []
    for name, m in med.items():
        config = CASES[name]
        rows.append([f"`{name}`: {config['epochs']} epochs x {config['size']} images", f"{m['direct']:.3f}",
                     f"{m['total']:.3f}", f"{1000 * m['claim']:.0f}", f"{m['run']:.3f}",
                     f"{m['total'] / m['direct']:.2f}x"])
    n = CASES["epochs"]["epochs"] - CASES["start"]["epochs"]
    per_direct = (med["epochs"]["direct"] - med["start"]["direct"]) / n
    per_job = (med["epochs"]["run"] - med["start"]["run"]) / n
    print(f"\n{env_line()}; {args.rounds} rounds, medians\n")
    print(table(["case", "direct call (s)", "run job, submit -> succeeded (s)", "of which submit -> running (ms)",
                 "running -> succeeded (s)", "run job / direct"], rows))
    print()
    print(table(["derived", "direct call", "run job", "difference"], [
        ["job start and finish (the `start` case)", f"{med['start']['direct']:.3f} s", f"{med['start']['total']:.3f} s",
         f"+{med['start']['total'] - med['start']['direct']:.3f} s"],
        ["one epoch's step, evaluation, report and checkpoint", f"{1000 * per_direct:.2f} ms",
         f"{1000 * per_job:.2f} ms", f"{1000 * (per_job - per_direct):+.2f} ms"],
    ]))
    print(f"\nafter the run: {load_note()}")


if __name__ == "__main__":
    main()
