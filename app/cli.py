"""The `trainyard` command: run the server and workers, and talk to the API.

Human-readable tables by default, `--json` for scripts. Client commands talk to TRAINYARD_URL
and send TRAINYARD_API_TOKEN as a bearer token when it is set.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from app.settings import Settings, get_settings

console = Console()
err = Console(stderr=True)


# ---- running the service ----------------------------------------------------------------------

def cmd_serve(args, settings: Settings) -> int:
    import uvicorn

    from app.api import create_app
    host = args.host or settings.host
    port = args.port or settings.port
    uvicorn.run(create_app(settings), host=host, port=port, log_level=args.log_level)
    return 0


def cmd_worker(args, settings: Settings) -> int:
    from worker.main import main as worker_main
    return worker_main(settings, args.device, burst=args.burst, max_jobs=args.max_jobs)


def cmd_up(args, settings: Settings) -> int:
    """The server plus one worker per visible CUDA device (or CPU workers), stopped together on Ctrl-C."""
    from app.devices import visible_cuda_count
    n_gpus = visible_cuda_count()
    devices = [f"cuda:{i}" for i in range(n_gpus)] if n_gpus else ["cpu"] * args.cpu_workers
    exe = [sys.executable, "-m", "app.cli"]
    host, port = args.host or settings.host, args.port or settings.port
    procs = [subprocess.Popen([*exe, "serve", "--host", host, "--port", str(port)])]
    procs += [subprocess.Popen([*exe, "worker", "--device", d]) for d in devices]
    err.print(f"trainyard: API on http://{host}:{port} (docs at /docs), workers on {', '.join(devices)}; "
              f"Ctrl-C stops all")
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = 0
    while not stopping:
        for p in procs:
            if p.poll() is not None:
                err.print(f"trainyard: {p.args[3]} exited with code {p.returncode}; stopping the rest")
                code = p.returncode or 1
                stopping = True
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + settings.grace_s + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    return code


# ---- the client -------------------------------------------------------------------------------

def client(settings: Settings) -> httpx.Client:
    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    return httpx.Client(base_url=settings.url, headers=headers, timeout=30)


def call(settings: Settings, method: str, path: str, **kw) -> httpx.Response:
    try:
        with client(settings) as c:
            r = c.request(method, path, **kw)
    except httpx.TransportError as exc:
        err.print(f"[red]cannot reach trainyard at {settings.url}: {exc}[/red]")
        raise SystemExit(2)
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail")
        except ValueError:
            detail = r.text
        if isinstance(detail, list):
            detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail)
        err.print(f"[red]error {r.status_code}: {detail}[/red]")
        raise SystemExit(1)
    return r


def cmd_submit(args, settings: Settings) -> int:
    try:
        body = json.loads(Path(args.file).read_text()) if args.file != "-" else json.load(sys.stdin)
    except (OSError, ValueError) as exc:
        err.print(f"[red]cannot read a JSON job from {args.file}: {exc}[/red]")
        return 2
    job = call(settings, "POST", "/jobs", json=body).json()
    if args.follow:
        job = follow(settings, job["id"])
    elif args.wait:
        job = wait_for(settings, job["id"], quiet=args.json)
    show_job(job, args.json)
    return 0 if job["state"] in ("queued", "running", "succeeded") else 1


def cmd_watch(args, settings: Settings) -> int:
    job = follow(settings, args.id)
    show_job(job, args.json)
    return 0 if job["state"] == "succeeded" else 1


def follow(settings: Settings, job_id: int) -> dict:
    """A live progress bar until the job ends: epoch of epochs, loss, accuracy, speed, device memory."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("job {task.fields[job]} [bold]{task.fields[state]:9}[/]"), BarColumn(),
               MofNCompleteColumn(), TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("", total=None, job=job_id, state="", stats="")
        while True:
            job = call(settings, "GET", f"/jobs/{job_id}").json()
            p = job["progress"]
            progress.update(task, total=p.get("epochs"), completed=p.get("epoch") or 0, state=job["state"],
                            stats=_stats(job))
            if job["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
    if job["state"] == "failed":
        err.print(f"[red]job {job_id} failed: [{job['error']['class']}] {job['error']['type']}: "
                  f"{job['error']['message']}[/red]")
    return job


def _stats(job: dict) -> str:
    m = job.get("latest_metrics") or {}
    parts = []
    if m.get("train_loss") is not None:
        parts.append(f"loss {m['train_loss']:.4f}")
    if m.get("val_accuracy") is not None:
        parts.append(f"val_acc {m['val_accuracy']:.3f}")
    if m.get("samples_per_s"):
        parts.append(f"{m['samples_per_s']:,.0f} samples/s")
    if m.get("memory_allocated") is not None:
        parts.append(f"mem {_mib(m['memory_allocated'])} alloc / {_mib(m.get('memory_reserved'))} reserved")
    if job.get("device"):
        parts.append(job["device"])
    return "  ".join(parts)


def wait_for(settings: Settings, job_id: int, quiet: bool = False) -> dict:
    last = None
    while True:
        job = call(settings, "GET", f"/jobs/{job_id}").json()
        line = f"job {job_id}: {job['state']} {_progress(job)}"
        if not quiet and line != last:
            err.print(line)
            last = line
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.5)


def _progress(job: dict) -> str:
    p, m = job["progress"], job.get("latest_metrics") or {}
    if not p.get("epochs"):
        return ""
    acc = f" val_acc {m['val_accuracy']:.3f}" if m.get("val_accuracy") is not None else ""
    loss = f" loss {m['train_loss']:.4f}" if m.get("train_loss") is not None else ""
    return f"epoch {p['epoch']}/{p['epochs']}{loss}{acc}"


def show_job(job: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(job, indent=2))
        return
    t = Table(show_header=False, box=None)
    for key in ("id", "kind", "name", "state", "device", "worker_id", "attempt", "created_at", "started_at",
                "finished_at"):
        t.add_row(key, str(job.get(key)))
    t.add_row("progress", _progress(job) or "-")
    if job.get("peak_memory_allocated"):
        t.add_row("peak memory", f"{_mib(job['peak_memory_allocated'])} allocated, "
                                 f"{_mib(job['peak_memory_reserved'])} reserved")
    if job.get("error"):
        t.add_row("error", f"[{job['error'].get('class')}] {job['error']['type']}: {job['error']['message']}")
    if job.get("result"):
        t.add_row("result", json.dumps(job["result"]))
    console.print(t)


def _mib(n) -> str:
    return f"{n / 2**20:.1f} MiB" if n is not None else "-"


def cmd_jobs(args, settings: Settings) -> int:
    params = {k: v for k, v in {"state": args.state, "kind": args.kind, "limit": args.limit}.items() if v}
    page = call(settings, "GET", "/jobs", params=params).json()
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    t = Table("id", "kind", "name", "state", "device", "progress", "created")
    for j in page["data"]:
        t.add_row(str(j["id"]), j["kind"], j["name"] or "", j["state"], j["device"] or j["spec"]["device"],
                  _progress(j), j["created_at"][:19])
    console.print(t)
    console.print(f"{len(page['data'])} of {page['count']} jobs")
    return 0


def cmd_status(args, settings: Settings) -> int:
    show_job(call(settings, "GET", f"/jobs/{args.id}").json(), args.json)
    return 0


def cmd_cancel(args, settings: Settings) -> int:
    show_job(call(settings, "POST", f"/jobs/{args.id}/cancel").json(), args.json)
    return 0


def cmd_retry(args, settings: Settings) -> int:
    show_job(call(settings, "POST", f"/jobs/{args.id}/retry").json(), args.json)
    return 0


def cmd_download(args, settings: Settings) -> int:
    r = call(settings, "GET", f"/jobs/{args.id}/artifact", params={"format": args.format})
    out = Path(args.output)
    tmp = out.with_name(out.name + ".part")
    tmp.write_bytes(r.content)
    os.replace(tmp, out)
    if args.json:
        print(json.dumps({"path": str(out), "bytes": len(r.content)}))
    else:
        err.print(f"wrote {out} ({len(r.content)} bytes)")
    return 0


def cmd_devices(args, settings: Settings) -> int:
    d = call(settings, "GET", "/devices").json()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    console.print(f"CUDA available: {d['cuda_available']}  torch {d['torch_version']}  CUDA {d['cuda_version']}  "
                  f"cuDNN {d['cudnn_version']}  driver {d['driver_version']}")
    t = Table("device", "name", "cc", "used / total", "workers (torch allocated / reserved)")
    for g in d["cuda_devices"]:
        ws = ", ".join(f"{w['id']} {w['state']} job {w['job_id']} "
                       f"({_mib((w['torch'] or {}).get('memory_allocated'))} / "
                       f"{_mib((w['torch'] or {}).get('memory_reserved'))})" for w in g["workers"])
        t.add_row(f"cuda:{g['index']}", g["name"], g["compute_capability"],
                  f"{_mib(g['memory_used'])} / {_mib(g['memory_total'])}", ws or "-")
    cpu = d["cpu"]
    t.add_row("cpu", f"{cpu['cores']} cores", "", f"{_mib(cpu['memory_total'] - (cpu['memory_available'] or 0))} / "
              f"{_mib(cpu['memory_total'])}", ", ".join(f"{w['id']} {w['state']} job {w['job_id']}"
                                                      for w in cpu["workers"]) or "-")
    console.print(t)
    return 0


def cmd_workers(args, settings: Settings) -> int:
    ws = call(settings, "GET", "/workers").json()
    if args.json:
        print(json.dumps(ws, indent=2))
        return 0
    t = Table("id", "host", "pid", "device", "state", "job", "heartbeat age (s)")
    for w in ws:
        t.add_row(w["id"], w["host"], str(w["pid"]), w["device"], w["state"], str(w["job_id"] or "-"),
                  f"{w['last_heartbeat_age_s']:.1f}")
    console.print(t)
    return 0


def cmd_logs(args, settings: Settings) -> int:
    sys.stdout.write(call(settings, "GET", f"/jobs/{args.id}/logs").text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainyard", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name, fn, help, json_flag=True):
        sp = sub.add_parser(name, help=help)
        sp.set_defaults(fn=fn)
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    s = add("serve", cmd_serve, "run the API server", json_flag=False)
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--log-level", default="info")
    w = add("worker", cmd_worker, "run a worker bound to one device", json_flag=False)
    w.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    w.add_argument("--max-jobs", type=int)
    u = add("up", cmd_up, "run the server and one worker per GPU (or a CPU worker)", json_flag=False)
    u.add_argument("--host")
    u.add_argument("--port", type=int)
    u.add_argument("--cpu-workers", type=int, default=1, help="CPU workers to start when there is no GPU")
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
                           ("logs", cmd_logs, "print a job's log"),
                           ("watch", cmd_watch, "show a job's live progress until it ends")):
        add(name, fn, help).add_argument("id", type=int)
    d = add("download", cmd_download, "download a train job's state_dict")
    d.add_argument("id", type=int)
    d.add_argument("-o", "--output", required=True)
    d.add_argument("--format", choices=["safetensors", "pt", "meta"], default="safetensors")
    add("devices", cmd_devices, "show CUDA devices, the CPU and their workers")
    add("workers", cmd_workers, "list workers")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args, get_settings())


if __name__ == "__main__":
    sys.exit(main())
