"""How the CLI shows a job: its table, its progress as text, a live progress bar or one line per change while
it runs (following its event stream), and what it made: its metrics per epoch and its result."""
import json
from collections.abc import Callable

from rich.table import Table

from trainyard.app.cli.output import console, err, mib, number, ride_out, shown, state_text
from trainyard.app.client import APIError, Client
from trainyard.app.core.states import JobState
from trainyard.app.core.text import escaped


def progress_text(job: dict) -> str:
    p, m = job["progress"], job.get("latest_metrics") or {}
    if not p.get("epochs"):
        return ""
    acc = f" val_acc {m['val_accuracy']:.3f}" if m.get("val_accuracy") is not None else ""
    loss = f" loss {m['train_loss']:.4f}" if m.get("train_loss") is not None else ""
    return f"epoch {p['epoch']}/{p['epochs']}{loss}{acc}"


def job_table(job: dict) -> None:
    t = Table(show_header=False, box=None)
    for key in ("id", "kind", "name", "state", "device", "worker_id", "attempt", "parameters", "created_at",
                "started_at", "finished_at"):
        t.add_row(key, state_text(job[key]) if key == "state" else shown(job.get(key)))
    t.add_row("progress", progress_text(job) or "-")
    if job.get("waiting_for"):
        t.add_row("waiting for", f"[yellow]{shown(job['waiting_for'])}[/yellow]")
    if job.get("peak_memory_allocated"):
        t.add_row("peak memory", f"{mib(job['peak_memory_allocated'])} allocated, "
                                 f"{mib(job['peak_memory_reserved'])} reserved")
    if job.get("error"):
        e = job["error"]
        t.add_row("error", shown(f"[{e.get('class')}] {e['type']}: {e['message']}"))
    if job.get("result"):
        t.add_row("result", shown(json.dumps(job["result"])))
    console.print(t)


def metrics_table(records: list[dict]) -> None:
    """One row per epoch record: its epoch and attempt, then a column per metric any record has (in the
    order they first come)."""
    names = dict.fromkeys(k for k in ("epoch", "attempt") if any(k in r for r in records))
    for r in records:
        names.update(dict.fromkeys(k for k, v in r.items() if v is not None))
    t = Table(*map(shown, names))
    for r in records:
        t.add_row(*(mib(r.get(k)) if k.startswith(("memory_", "max_memory_")) else number(r.get(k)) for k in names))
    console.print(t)


# Of each prediction's probabilities, a table shows the most likely few (--json has them all).
SHOWN_CLASSES = 3


def result_view(result: dict) -> None:
    """A predict job's predictions as a table (each row's class and its most likely classes); any other
    result (an evaluation, a train or run job's) as its fields."""
    rows = result.get("predictions")
    if isinstance(rows, list) and all(isinstance(r, dict) and "class" in r for r in rows):  # not a run job's own
        names = result.get("class_names") or []
        t = Table("row", "class", "most likely")
        for r in rows:
            top = r.get("top") or sorted(({"class": n, "probability": p} for n, p in
                                          zip(names, r.get("probabilities") or [])), key=lambda c: -c["probability"])
            t.add_row(str(r.get("index")), shown(r.get("class")),
                      shown(", ".join(f"{c['class']} {c['probability']:.4f}" for c in top[:SHOWN_CLASSES])))
        console.print(t)
        return
    t = Table(show_header=False, box=None)
    for key, value in result.items():
        t.add_row(shown(key), shown(number(value)))
    console.print(t)


def stats_text(job: dict) -> str:
    m = job.get("latest_metrics") or {}
    parts = []
    if m.get("train_loss") is not None:
        parts.append(f"loss {m['train_loss']:.4f}")
    if m.get("val_accuracy") is not None:
        parts.append(f"val_acc {m['val_accuracy']:.3f}")
    if m.get("samples_per_s"):
        parts.append(f"{m['samples_per_s']:,.0f} samples/s")
    if m.get("memory_allocated") is not None:
        parts.append(f"mem {mib(m['memory_allocated'])} alloc / {mib(m.get('memory_reserved'))} reserved")
    if job.get("device"):
        parts.append(job["device"])
    return shown("  ".join(parts))  # for a TextColumn, which reads markup
def follow(client: Client, job_id: int, on_change: Callable[[dict], None]) -> dict:
    """Follow the job's event stream until it ends, calling on_change(job) after each event; the
    ended job. A dropped connection is picked up again where it stopped (Last-Event-ID)."""
    job: dict | None = None
    failures_since, last_id = None, None
    while True:
        try:
            for ev in client.jobs.events(job_id, last_id):
                failures_since, last_id = None, ev.get("id") or last_id
                if ev["event"] == "state":
                    job = ev["data"]
                elif ev["event"] == "epoch" and job is not None:
                    metrics = ev["data"]
                    job = {**job, "latest_metrics": metrics, "progress": {**job["progress"], "epoch": metrics["epoch"]}}
                elif ev["event"] == "end":
                    job = client.jobs.get(job_id)
                    on_change(job)
                    return job
                if job is not None:
                    on_change(job)
        except APIError as exc:
            failures_since = ride_out(exc, failures_since)


def follow_bar(client: Client, job_id: int) -> dict:
    """A live progress bar until the job ends: epoch of epochs, loss, accuracy, speed, device memory."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("job {task.fields[job]} [bold]{task.fields[state]:9}[/]"), BarColumn(),
               MofNCompleteColumn(), TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("", total=None, job=job_id, state="", stats="")

        def draw(job: dict) -> None:
            p = job["progress"]
            progress.update(task, total=p.get("epochs"), completed=p.get("epoch") or 0, state=job["state"],
                            stats=stats_text(job))

        job = follow(client, job_id, draw)
    say_failure(job)
    return job


def follow_lines(client: Client, job_id: int, quiet: bool) -> dict:
    """One line per change of state or progress until the job ends (for logs and dumb terminals)."""
    last = None

    def line(job: dict) -> None:
        nonlocal last
        text = f"job {job_id}: {job['state']} {progress_text(job)}"
        if not quiet and text != last:
            err.print(text, highlight=False)
            last = text

    return follow(client, job_id, line)


def say_failure(job: dict) -> None:
    if job["state"] == JobState.FAILED:
        e = job["error"]
        err.print(escaped(f"job {job['id']} failed: [{e['class']}] {e['type']}: {e['message']}"), style="red",
                  markup=False, highlight=False)
    elif job["state"] == JobState.PRUNED:  # its sweep stopped it early: why, not an error
        err.print(escaped(f"job {job['id']} {(job.get('error') or {}).get('message') or 'pruned'}"), style="yellow",
                  markup=False, highlight=False)
