"""What MLflow tracking costs a job: a 100-epoch Iris job (the README's, a checkpoint every epoch) tracked
against the same job with tracking off, side by side in one run, on one service and one worker, with a real
`mlflow server` (SQLite backend) on this machine.

Run: `.venv/bin/python -m bench.tracking [--rounds 5] [--epochs 100]` from the repository root (needs the mlflow
package of the test extra: `make setup`).

Both sides are the same spec, one with `"tracking": {"mlflow": false}`; rounds alternate after a warm-up of each.
Shown per side (medians): the job's run (started_at -> finished_at, the database's clock) and submit -> succeeded;
for the tracked side, how long after the job ended its MLflow run was complete (every epoch, the model's files,
the status), which the job never waits for. The issue's bound: tracked runs take at most 5% longer.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import env_line, iso_s, service, table
from tests.helpers.mlflow import mlflow_server
from trainyard.app.spec import TRAIN_EXAMPLE


def one(c, tracked: bool, epochs: int) -> dict[str, float]:
    spec = {**TRAIN_EXAMPLE, "device": "cpu", "train": {**TRAIN_EXAMPLE["train"], "epochs": epochs,
                                                        "checkpoint_every": 1}}
    if not tracked:
        spec["tracking"] = {"mlflow": False}
    job = c.post("/jobs", json=spec).raise_for_status().json()
    t0 = time.monotonic()
    while job["state"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.1)
        job = c.get(f"/jobs/{job['id']}").raise_for_status().json()
    if job["state"] != "succeeded":
        raise RuntimeError(f"job {job['id']} {job['state']}: {job['error']}")
    ended = time.monotonic()
    lag = 0.0
    if tracked:
        while not (job.get("tracking") or {}).get("mlflow", {}).get("complete"):
            time.sleep(0.05)
            job = c.get(f"/jobs/{job['id']}").raise_for_status().json()
            if time.monotonic() - ended > 120:
                raise RuntimeError(f"job {job['id']}'s run not complete after 120 s: {job['tracking']}")
        lag = time.monotonic() - ended
    return {"run": iso_s(job["finished_at"]) - iso_s(job["started_at"]),
            "total": iso_s(job["finished_at"]) - iso_s(job["created_at"]), "lag": lag, "wall": ended - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainyard-mlflow-") as tmp, mlflow_server(Path(tmp)) as tracker, \
            service(workers=1, env={"TRAINYARD_MLFLOW_TRACKING_URI": tracker.uri}) as svc, svc.client() as c:
        for tracked in (True, False):  # warm-up: the fork server's first job, the experiment's making
            one(c, tracked, args.epochs)
        got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for tracked in (True, False):
                got[tracked].append(one(c, tracked, args.epochs))
    med = {side: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for side, rows in got.items()}
    ratio = med[True]["run"] / med[False]["run"]
    print(f"# bench.tracking: {args.epochs}-epoch Iris job, checkpoint every epoch, {args.rounds} rounds, medians")
    print(env_line())
    print(table(["side", "run (s)", "submit -> succeeded (s)", "run complete in MLflow after the job (s)"],
                [["tracking off", f"{med[False]['run']:.3f}", f"{med[False]['total']:.3f}", "-"],
                 ["tracking on", f"{med[True]['run']:.3f}", f"{med[True]['total']:.3f}", f"{med[True]['lag']:.2f}"]]))
    print(f"tracked / untracked run time: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; bound: +5%) -> "
          f"{'met' if ratio <= 1.05 else 'NOT met'}")
    print("runs (s), on:", [round(r["run"], 3) for r in got[True]], "off:", [round(r["run"], 3) for r in got[False]])


if __name__ == "__main__":
    main()
