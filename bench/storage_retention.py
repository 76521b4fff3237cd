"""Storage retention benchmark: what a mix of 200 jobs leaves in the store, and what the collector's passes leave of
it with the default rules, now and as if a month later.

Run: `.venv/bin/python -m bench.storage_retention [--workers 2]` from the repository root (about 3-5 minutes
on 2 cores). Not a test: it prints tables.

One service (`trainyard serve` plus --workers CPU workers, SQLite, the data directory as the store, production
timings, every retention setting at its default; TRAINYARD_COLLECT_S is a year, so that only this process's passes
run: app/collector.collect, called here against the service's database and store). The mix, 200 jobs:
- 20 slow jobs (digits CNN, 40 epochs, a checkpoint every epoch) cancelled once each has checkpointed;
- 140 Iris jobs (MLP [8], 3 epochs, a checkpoint every epoch) that succeed;
- 20 that fail at run time: half diverge (SGD, lr 10, momentum 0.99: the loss is nan in epoch 1, before any
  checkpoint), half run out of time (the slow job with timeout_s 2, after a checkpoint or more);
- one grid sweep of 20 trials (the Iris job over 20 learning rates, keep_best unset: TRAINYARD_SWEEP_KEEP_BEST).
Then the store's bytes and objects per kind (collector.KINDS: the store's listing, by collector.kind_of; `cache`
is this host's decoded datasets, app/lifecycle/host_cache.py), before any pass, after a pass now, after a pass once the
grace period (collect_grace_s) has passed, and after a pass 31 days on (collect(..., shift_s=...)).
"""
import argparse
import random
import time
from collections import Counter
from typing import Any, cast

from sqlalchemy import func, select

from bench.common import TINY_JOB, env_line, load_note, service, table
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import TERMINAL
from trainyard.app.db import jobs, make_engine, read
from trainyard.app.launcher import Service
from trainyard.app.lifecycle import collector, host_cache

DAY = 86400.0
RULES = ("checkpoint_ttl_s", "ended_job_ttl_s", "sweep_keep_best", "log_ttl_s", "export_ttl_s", "collect_grace_s")
Stage = tuple[str, dict[str, tuple[int, int]], collector.Report | None, Counter]
EACH_EPOCH = {"checkpoint_every": 1, "checkpoint_every_s": 0}


def iris(lr: float | None = None) -> dict:
    train = {**cast(dict, TINY_JOB["train"]), "epochs": 3, **EACH_EPOCH, **({"lr": lr} if lr is not None else {})}
    return {**TINY_JOB, "name": "bench-retention", "train": train}


def diverging() -> dict:
    return {**TINY_JOB, "name": "bench-retention-fails", "model": {"arch": "mlp", "hidden": [256, 256, 256]},
            "train": {"epochs": 20, "batch_size": 8, "optimizer": "sgd", "lr": 10.0, "momentum": 0.99, **EACH_EPOCH}}


def slow(**fields: Any) -> dict:
    return {**fields, "kind": "train", "name": "bench-retention-slow", "model": {"arch": "cnn", "channels": [16, 32]},
            "data": {"dataset": "digits"}, "device": "cpu",
            "train": {"epochs": 40, "batch_size": 16, "lr": 0.001, **EACH_EPOCH}}


def states(engine) -> Counter:
    with read(engine) as conn:
        return Counter(dict(conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state)).all()))


def cancel_each_once_checkpointed(svc: Service, engine, n: int) -> None:
    with svc.client() as c:
        ids = {c.post("/jobs", json=slow()).raise_for_status().json()["id"] for _ in range(n)}
        deadline = time.monotonic() + 300
        while ids:
            assert time.monotonic() < deadline, f"jobs {sorted(ids)} never checkpointed"
            with read(engine) as conn:
                ready = conn.execute(select(jobs.c.id).where(jobs.c.id.in_(ids), jobs.c.state == "running",
                                                             jobs.c.checkpoint_epoch >= 1)).scalars().all()
            for job_id in ready:
                c.post(f"/jobs/{job_id}/cancel").raise_for_status()
                ids.discard(job_id)
            time.sleep(0.1)


def run_mix(svc: Service, engine, args) -> float:
    t0 = time.monotonic()
    cancel_each_once_checkpointed(svc, engine, args.cancelled)
    lrs = [round(10 ** (-3 + 2.5 * i / max(1, args.trials - 1)), 6) for i in range(args.trials)]
    with svc.client() as c:
        sweep = c.post("/sweeps", json={"name": "bench-retention", "job": iris(), "method": "grid",
                                        "metric": "val_loss", "max_concurrent": args.workers,
                                        "parameters": {"train.lr": {"type": "choice", "values": lrs}}})
        sweep_id = sweep.raise_for_status().json()["id"]
        mix = [iris()] * args.succeed + [diverging(), slow(timeout_s=2)] * (args.fail // 2)
        random.Random(0).shuffle(mix)  # the failing jobs among the others, the same each run
        for body in mix:
            c.post("/jobs", json=body).raise_for_status()
        total = args.cancelled + args.succeed + args.fail + args.trials
        svc.wait_until(lambda: sum(states(engine)[s] for s in TERMINAL) == total
                       and c.get(f"/sweeps/{sweep_id}").json()["state"] != "running", 600, f"{total} jobs to end")
    return time.monotonic() - t0


def measure(settings: Settings) -> dict[str, tuple[int, int]]:
    """(bytes, objects) per kind, from the store's listing; `cache`: this host's caches."""
    store = settings.store
    out = {kind: [0, 0] for kind in collector.KINDS}
    for folder in collector.FOLDERS:
        for e in store.entries(folder):
            kind = collector.kind_of(e.key)
            if kind is not None:
                out[kind][0] += e.size
                out[kind][1] += 1
    out["cache"] = list(host_cache.measure(store))
    return {k: (b, n) for k, (b, n) in out.items()}


def size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--succeed", type=int, default=140)
    ap.add_argument("--fail", type=int, default=20)
    ap.add_argument("--cancelled", type=int, default=20)
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    if args.fail % 2:
        ap.error("--fail: an even number (half diverge, half run out of time)")
    env = env_line()
    defaults: dict[str, Any] = {name: Settings.model_fields[name].default for name in RULES}
    with service(workers=args.workers, env={"TRAINYARD_COLLECT_S": str(365 * DAY)}) as svc:
        # The defaults passed explicitly: no TRAINYARD_* of this shell changes them.
        settings = Settings(data_dir=svc.data_dir, database_url="", storage_url="", **defaults)
        engine = make_engine(settings.db_url)
        try:
            wall = run_mix(svc, engine, args)
            stages: list[Stage] = [("before any pass", measure(settings), None, states(engine))]
            grace = settings.collect_grace_s
            for name, shift in (("pass now", 0.0), (f"pass +{grace:.0f} s (grace over)", grace + 1),
                                ("pass +31 days", 31 * DAY)):
                report = collector.collect(engine, settings, shift_s=shift)
                stages.append((name, measure(settings), report, states(engine)))
        finally:
            engine.dispose()
    print_tables(env, args, wall, defaults, stages)


def print_tables(env: str, args, wall: float, defaults: dict[str, Any], stages: list[Stage]) -> None:
    print(f"\n{env}")
    n = args.succeed + args.fail + args.cancelled + args.trials
    print(f"command: .venv/bin/python -m bench.storage_retention --workers {args.workers} --succeed {args.succeed} "
          f"--fail {args.fail} --cancelled {args.cancelled} --trials {args.trials}")
    print(f"{n} jobs on {args.workers} CPU workers in {wall:.0f} s: {args.succeed} Iris jobs that succeed, {args.fail} "
          f"that fail at run time, {args.cancelled} cancelled after a checkpoint, a grid sweep of {args.trials} "
          f"trials; every job checkpoints each epoch. Rules: "
          + ", ".join(f"{k}={v:g}" for k, v in defaults.items()) + "\n")
    print(table(["kind", *(s[0] for s in stages)],
                [[kind, *(f"{size(s[1][kind][0])} / {s[1][kind][1]}" for s in stages)] for kind in collector.KINDS]
                + [["total (without cache)", *(f"{size(sum(b for k, (b, _) in s[1].items() if k != 'cache'))} / "
                                               f"{sum(o for k, (_, o) in s[1].items() if k != 'cache')}"
                                               for s in stages)]]))
    print("\n(bytes / objects of the store's listing, by collector.kind_of; cache: this host's decoded datasets)\n")
    print(table(["pass", "took (ms)", "objects deleted", "bytes deleted", "checkpoints dropped", "jobs deleted",
                 "trials reclaimed", "job rows by state after"],
                [[name, f"{1000 * r.took_s:.0f}", r.deleted_objects, size(r.deleted_bytes), r.checkpoints_dropped,
                  r.jobs_deleted, r.trials_reclaimed, ", ".join(f"{k} {v}" for k, v in sorted(st.items()))]
                 for name, _, r, st in stages if r is not None]))
    print(f"\nAt the end: {load_note()}.")


if __name__ == "__main__":
    main()
