"""Client commands: submit, jobs, status, watch, logs, cancel, retry, download, devices, workers, drain,
undrain, upload; and the sweeps': sweep, sweeps, sweep-status, sweep-watch, sweep-cancel."""
import argparse
import json
import sys
import time
from pathlib import Path

from rich.table import Table

from trainyard.app.cli.output import (
    TerminalWriter,
    console,
    counts_text,
    err,
    error,
    follow_bar,
    follow_lines,
    follow_sweep_table,
    job_table,
    mib,
    number,
    progress_text,
    say_best,
    say_failure,
    show,
    shown,
    sweep_summary,
)
from trainyard.app.client import TERMINAL, APIError, Client
from trainyard.app.states import JobState

# After a log was trimmed under a follower, it goes on from this many of the latest bytes.
FOLLOW_AFTER_TRIM = 64 << 10


def add_commands(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output (errors too, on stderr)")
    common.add_argument("--url", help="the API (default: TRAINYARD_URL or http://127.0.0.1:8000)")
    common.add_argument("--token", help="bearer token (default: TRAINYARD_API_TOKEN)")

    def add(name, fn, help):
        sp = sub.add_parser(name, help=help, parents=[common])
        sp.set_defaults(fn=lambda args: run(fn, args))
        return sp

    s = add("submit", cmd_submit, "submit a job from a JSON file ('-' for stdin)")
    s.add_argument("file")
    s.add_argument("--wait", action="store_true", help="wait until the job ends")
    s.add_argument("--follow", action="store_true", help="show a live progress bar until the job ends")
    j = add("jobs", cmd_jobs, "list jobs, newest first")
    j.add_argument("--state")
    j.add_argument("--kind")
    j.add_argument("--limit", type=int, default=50)
    for name, fn, help in (("status", cmd_status, "show a job"), ("cancel", cmd_cancel, "cancel a job"),
                           ("retry", cmd_retry, "requeue a failed or cancelled job"),
                           ("watch", cmd_watch, "show a job's live progress until it ends")):
        add(name, fn, help).add_argument("id", type=int)
    lg = add("logs", cmd_logs, "print a job's log")
    lg.add_argument("id", type=int)
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    lg.add_argument("--tail", type=int, metavar="BYTES", help="only the log's last BYTES (from a line's start)")
    d = add("download", cmd_download, "download a train job's state_dict")
    d.add_argument("id", type=int)
    d.add_argument("-o", "--output", required=True)
    d.add_argument("--format", choices=["safetensors", "pt", "meta"], default="safetensors")
    add("devices", cmd_devices, "show CUDA devices, the CPU and their workers")
    add("workers", cmd_workers, "list workers")
    for name, fn, help in (("drain", cmd_drain, "let a worker finish its job and claim nothing more"),
                           ("undrain", cmd_undrain, "let a drained worker claim jobs again")):
        add(name, fn, help).add_argument("worker_id", help="as `trainyard workers` lists it")
    up = add("upload", cmd_upload, "upload a dataset (.csv, .npz, ImageFolder .zip)")
    up.add_argument("file")
    up.add_argument("--label-column", help="CSV: the column of class labels")
    sw = add("sweep", cmd_sweep, "start a hyperparameter sweep from a JSON file ('-' for stdin)")
    sw.add_argument("file")
    sw.add_argument("--follow", action="store_true", help="show a live table of its trials until it ends, then "
                                                          "its best trial")
    sl = add("sweeps", cmd_sweeps, "list sweeps, newest first")
    sl.add_argument("--state")
    sl.add_argument("--limit", type=int, default=50)
    for name, fn, help in (("sweep-status", cmd_sweep_status, "show a sweep and its trials"),
                           ("sweep-watch", cmd_sweep_watch, "show a sweep's live table of trials until it ends"),
                           ("sweep-cancel", cmd_sweep_cancel, "cancel a sweep and its unfinished trials")):
        add(name, fn, help).add_argument("id", type=int)


def run(fn, args) -> int:
    with Client(url=args.url, token=args.token) as client:
        try:
            return fn(client, args)
        except APIError as exc:
            return error(exc, args.json)


def read_json(path: str, what: str):
    """The JSON in a file ('-': stdin); None, said on stderr, when it cannot be read."""
    try:
        return json.loads(Path(path).read_text()) if path != "-" else json.load(sys.stdin)
    except (OSError, ValueError) as exc:
        err.print(f"cannot read a JSON {what} from {path}: {exc}", style="red", markup=False, highlight=False)
        return None


def cmd_submit(client: Client, args) -> int:
    body = read_json(args.file, "job")
    if body is None:
        return 2
    job = client.submit(body)
    if args.follow:
        job = follow_bar(client, job["id"])
    elif args.wait:
        job = follow_lines(client, job["id"], quiet=args.json)
        say_failure(job)
    show(job, args.json, job_table)
    return 0 if job["state"] not in (JobState.FAILED, JobState.CANCELLED) else 1


def cmd_watch(client: Client, args) -> int:
    job = follow_bar(client, args.id)
    show(job, args.json, job_table)
    return 0 if job["state"] == JobState.SUCCEEDED else 1


def cmd_status(client: Client, args) -> int:
    show(client.get(args.id), args.json, job_table)
    return 0


def cmd_cancel(client: Client, args) -> int:
    show(client.cancel(args.id), args.json, job_table)
    return 0


def cmd_retry(client: Client, args) -> int:
    show(client.retry(args.id), args.json, job_table)
    return 0


def cmd_jobs(client: Client, args) -> int:
    page = client.list(state=args.state, kind=args.kind, limit=args.limit)

    def render(page: dict) -> None:
        t = Table("id", "kind", "name", "state", "device", "progress", "created")
        for j in page["data"]:
            ran = " + ".join(r["device"] for r in j.get("ranks") or []) or j["device"]  # each rank's device
            t.add_row(str(j["id"]), j["kind"], shown(j["name"] or ""), j["state"], shown(ran or j["requested_device"]),
                      progress_text(j), j["created_at"][:19])
        console.print(t)
        console.print(f"{len(page['data'])} of {page['count']} jobs")

    show(page, args.json, render)
    return 0


def cmd_logs(client: Client, args) -> int:
    """The log so far (or its last --tail bytes); with -f, what the job prints next until it ends, each
    read asking only for the bytes after the last one's."""
    if args.tail is not None and args.tail < 1:
        raise SystemExit("trainyard logs: --tail must be at least 1")
    out = TerminalWriter(sys.stdout.buffer)  # the job's own output, but nothing that acts on the terminal
    data, start, _size = client.read_log(args.id, tail=args.tail)
    while True:
        out.write(data)
        out.flush()
        offset = start + len(data)
        if not args.follow:
            return 0
        ended = client.get(args.id)["state"] in TERMINAL
        data, start, size = client.read_log(args.id, offset=offset)
        if size < offset:  # trimmed to its cap while we read: go on from its latest lines
            data, start, size = client.read_log(args.id, tail=FOLLOW_AFTER_TRIM)
            out.write(b"\n[trainyard logs: the log was trimmed to its cap here]\n")
        if ended and not data:
            return 0
        if not data:
            time.sleep(0.5)


def cmd_download(client: Client, args) -> int:
    out = client.download(args.id, args.output, args.format)
    size = out.stat().st_size
    if args.json:
        print(json.dumps({"path": str(out), "bytes": size}))
    else:
        err.print(f"wrote {out} ({size} bytes)", highlight=False)
    return 0


def cmd_devices(client: Client, args) -> int:
    def render(d: dict) -> None:
        console.print(f"CUDA available: {d['cuda_available']}  torch {d['torch_version']}  CUDA {d['cuda_version']}  "
                      f"cuDNN {d['cudnn_version']}  driver {d['driver_version']}")
        t = Table("device", "name", "cc", "used / total", "workers (torch allocated / reserved)")
        for g in d["cuda_devices"]:
            ws = ", ".join(f"{w['id']} {w['state']} job {w['job_id']} "
                           f"({mib((w['torch'] or {}).get('memory_allocated'))} / "
                           f"{mib((w['torch'] or {}).get('memory_reserved'))})" for w in g["workers"])
            t.add_row(f"cuda:{g['index']}", shown(g["name"]), g["compute_capability"],
                      f"{mib(g['memory_used'])} / {mib(g['memory_total'])}", shown(ws or "-"))
        cpu = d["cpu"]
        t.add_row("cpu", f"{cpu['cores']} cores", "",
                  f"{mib(cpu['memory_total'] - (cpu['memory_available'] or 0))} / {mib(cpu['memory_total'])}",
                  shown(", ".join(f"{w['id']} {w['state']} job {w['job_id']}" for w in cpu["workers"]) or "-"))
        console.print(t)
        for w in d.get("other_workers") or []:  # GPU workers on no listed GPU: say why
            console.print(f"{w['id']} ({w['host']} {w['device']}) {w['state']}: {w.get('unavailable') or 'GPU not listed'}")

    show(client.devices(), args.json, render)
    return 0


def cmd_workers(client: Client, args) -> int:
    show(client.workers(), args.json, worker_table)
    return 0


def cmd_drain(client: Client, args) -> int:
    show(client.drain(args.worker_id), args.json, lambda w: worker_table([w]))
    return 0


def cmd_undrain(client: Client, args) -> int:
    show(client.undrain(args.worker_id), args.json, lambda w: worker_table([w]))
    return 0


def worker_table(ws: list) -> None:
    t = Table("id", "host", "pid", "device", "state", "job", "heartbeat age (s)")
    for w in ws:
        state = f"{w['state']} (draining)" if w.get("draining") else w["state"]
        if w.get("unavailable"):
            state = f"{state}: {w['unavailable']}"
        t.add_row(shown(w["id"]), shown(w["host"]), str(w["pid"]), shown(w["device"]), shown(state),
                  str(w["job_id"] or "-"), f"{w['last_heartbeat_age_s']:.1f}")
    console.print(t)


def cmd_upload(client: Client, args) -> int:
    def render(d: dict) -> None:
        console.print(f"uploaded {shown(d['name'])} as {d['dataset']}: {d['samples']} samples of shape "
                      f"{d['input_shape']}, {len(d['classes'])} classes")

    show(client.upload(args.file, args.label_column), args.json, render)
    return 0


def cmd_sweep(client: Client, args) -> int:
    body = read_json(args.file, "sweep")
    if body is None:
        return 2
    sweep = client.submit_sweep(body)
    if not args.follow:
        show(sweep, args.json, sweep_summary)
        return 0 if sweep["state"] not in (JobState.FAILED, JobState.CANCELLED) else 1
    return watch_sweep(client, sweep["id"], args.json)


def cmd_sweep_watch(client: Client, args) -> int:
    return watch_sweep(client, args.id, args.json)


def watch_sweep(client: Client, sweep_id: int, as_json: bool) -> int:
    """The live table until the sweep ends, then its best trial; 0 only when the sweep succeeded."""
    sweep = follow_sweep_table(client, sweep_id)
    show(sweep, as_json, say_best)  # the table stays on stderr: stdout gets only the answer
    return 0 if sweep["state"] == JobState.SUCCEEDED else 1


def cmd_sweep_status(client: Client, args) -> int:
    show(client.sweep(args.id), args.json, sweep_summary)
    return 0


def cmd_sweep_cancel(client: Client, args) -> int:
    show(client.cancel_sweep(args.id), args.json, sweep_summary)
    return 0


def cmd_sweeps(client: Client, args) -> int:
    page = client.sweeps(state=args.state, limit=args.limit)

    def render(page: dict) -> None:
        t = Table("id", "name", "state", "method", "metric", "trials", "counts", "best", "created")
        for s in page["data"]:
            best = s.get("best")
            t.add_row(str(s["id"]), shown(s.get("name") or ""), s["state"], s["method"],
                      f"{s['metric']} ({s.get('direction') or '?'})",
                      f"{s.get('trial_count') or 0}/{s.get('max_trials') or '?'}", counts_text(s.get("counts") or {}),
                      f"{number(best['value'])} (trial {best['trial']})" if best else "-", when(s.get("created_at")))
        console.print(t)
        console.print(f"{len(page['data'])} of {page['count']} sweeps")

    show(page, args.json, render)
    return 0


def when(t: str | None) -> str:
    """A time from the API (ISO 8601, UTC) as 'YYYY-MM-DD HH:MM:SS'."""
    return "" if t is None else t[:19].replace("T", " ")
