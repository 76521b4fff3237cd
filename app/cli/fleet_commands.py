"""Client commands about the machines: devices, workers, drain, undrain."""
from rich.table import Table

from trainyard.app.cli.calls import by_id
from trainyard.app.cli.output import console, mib, show, shown
from trainyard.app.client import Client


def add_fleet_commands(add) -> None:
    """The machine commands' parsers, through the client commands' `add` (commands.py)."""
    add("devices", cmd_devices, "show CUDA devices, the CPU and their workers")
    add("workers", cmd_workers, "list workers")
    for name, fn, help in (
            ("drain", by_id(lambda c, i: c.workers.drain(i), lambda w: worker_table([w]), "worker_id"),
             "let a worker finish its job and claim nothing more"),
            ("undrain", by_id(lambda c, i: c.workers.undrain(i), lambda w: worker_table([w]), "worker_id"),
             "let a drained worker claim jobs again")):
        add(name, fn, help).add_argument("worker_id", help="the worker's id, as `trainyard workers` lists it")


def cmd_devices(client: Client, args) -> int:
    def render(d: dict) -> None:
        # A version the host lacks (no driver, a CPU build of torch) is left out rather than shown as None.
        versions = "".join(f"  {name} {shown(d[key])}" for name, key in (
            ("torch", "torch_version"), ("CUDA", "cuda_version"), ("cuDNN", "cudnn_version"),
            ("driver", "driver_version")) if d.get(key) is not None)
        console.print(f"CUDA available: {d['cuda_available']}{versions}")
        t = Table("device", "name", "cc", "used / total", "workers (torch allocated / reserved)")
        for g in d["cuda_devices"]:
            ws = ", ".join(f"{worker_text(w)} "
                           f"({mib((w['torch'] or {}).get('memory_allocated'))} / "
                           f"{mib((w['torch'] or {}).get('memory_reserved'))})" for w in g["workers"])
            t.add_row(f"cuda:{g['index']}", shown(g["name"]), g["compute_capability"],
                      f"{mib(g['memory_used'])} / {mib(g['memory_total'])}", shown(ws or "-"))
        cpu = d["cpu"]
        t.add_row("cpu", f"{cpu['cores']} cores", "",
                  f"{mib(cpu['memory_total'] - (cpu['memory_available'] or 0))} / {mib(cpu['memory_total'])}",
                  shown(", ".join(worker_text(w) for w in cpu["workers"]) or "-"))
        console.print(t)
        for w in d.get("other_workers") or []:  # GPU workers on no listed GPU: say why
            why = w.get("unavailable") or "GPU not listed"
            console.print(f"{w['id']} ({w['host']} {w['device']}) {w['state']}: {why}")

    show(client.devices(), args.json, render)
    return 0


def worker_text(w: dict) -> str:
    """A worker as `devices` lists it: its id, its state and the job it runs (an idle one runs none)."""
    return f"{w['id']} {w['state']}" + (f" job {w['job_id']}" if w.get("job_id") is not None else "")


def cmd_workers(client: Client, args) -> int:
    show(client.workers.list().data, args.json, worker_table)
    return 0



def worker_table(ws: list) -> None:
    t = Table("id", "host", "pid", "device", "state", "job", "heartbeat age (s)")
    for w in ws:
        state = f"{w['state']} (draining)" if w.get("draining") else w["state"]
        if w.get("unavailable"):
            state = f"{state}: {w['unavailable']}"
        t.add_row(shown(w["id"]), shown(w["host"]), str(w["pid"] or "-"), shown(w["device"]), shown(state),
                  str(w["job_id"] or "-"), f"{w['last_heartbeat_age_s']:.1f}")
    console.print(t)
