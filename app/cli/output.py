"""How the CLI shows things: JSON for scripts, rich tables, a live progress bar (jobs) and a live table of
trials (sweeps) for people.

Every string a client or a job chose (names, parameters, error messages, the server's words that may
quote them) is printed through shown() (markup read) or escaped() (Text, markup=False): its control
characters as escapes (\\x1b), so that a name cannot set the clipboard or clear the screen, and its Rich
markup as text, so that "[link=...]" is not a hyperlink. JSON output escapes control characters itself.
A job's log (`trainyard logs`) is its own output, printed as such through TerminalWriter: colours kept,
every other escape sequence taken out.
"""
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from trainyard.app.client import TERMINAL, APIError, Client, describe
from trainyard.app.states import JobState
from trainyard.app.text import escaped

console = Console()
err = Console(stderr=True)


def shown(value: Any) -> str:
    """Client text for what reads Rich markup (console.print, a table's str cells): control characters as
    escapes, markup escaped. For Text() and markup=False prints: escaped()."""
    return escape(escaped(value))


# What in a log acts on the terminal: CSI sequences (kept only when they set colours: SGR, ending in
# "m"), OSC strings (the title, the clipboard, hyperlinks), DCS, SOS, PM and APC strings, any other
# escape, a lone ESC, the C0 controls but tab, newline and carriage return (progress bars), DEL, and
# the C1 controls (UTF-8 encoded: 8-bit CSI and OSC).
_LOG_SEQUENCE = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[ -/]*[0-~]"
                           rb"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\xc2[\x80-\x9f]")
# A sequence that the end of a read cut (an OSC string without its end, a CSI without its final byte, a
# lone ESC, the first byte of a C1 control) waits for the next read, up to _LOG_HELD_MAX bytes (beyond,
# its ESC goes and its text is printed as text).
_LOG_UNFINISHED = re.compile(rb"(?:\x1b[\]PX^_][^\x07\x1b]*\x1b?|\x1b\[[0-?]*[ -/]*|\x1b[ -/]*|\xc2)\Z")
_LOG_HELD_MAX = 4096


class TerminalWriter:
    """A job's log bytes to out (stdout's buffer) with the sequences that would act on the terminal taken
    out (colours kept); a sequence split across writes is held until it is whole."""

    def __init__(self, out: BinaryIO):
        self.out, self.held = out, b""

    def write(self, data: bytes) -> None:
        data = self.held + data
        unfinished = _LOG_UNFINISHED.search(data, max(0, len(data) - _LOG_HELD_MAX))
        cut = unfinished.start() if unfinished else len(data)
        self.held = data[cut:]
        self.out.write(_LOG_SEQUENCE.sub(lambda m: m.group() if m.group().endswith(b"m") and
                                         m.group().startswith(b"\x1b[") else b"", data[:cut]))

    def flush(self) -> None:
        self.out.flush()


def show(obj: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    if as_json:
        print(json.dumps(obj, indent=2))
    else:
        render(obj)


def error(exc: APIError, as_json: bool) -> int:
    """Report a failed request on stderr; the exit code (2: unreachable, 1: refused)."""
    if as_json:
        print(json.dumps({"error": {"status_code": exc.status_code, "detail": exc.detail}}), file=sys.stderr)
    elif exc.status_code == 0:
        err.print(escaped(exc.detail), style="red", markup=False, highlight=False)
    else:
        # markup=False: the server's words are shown as sent ("[job]" or "[/x]" in them are not rich tags),
        # but for control characters (a 422 names the offending key of a sweep's parameters)
        err.print(f"error {exc.status_code}: {escaped(describe(exc.detail))}", style="red", markup=False,
                  highlight=False)
    return 2 if exc.status_code == 0 else 1


def mib(n) -> str:
    return f"{n / 2**20:.1f} MiB" if n is not None else "-"


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
        t.add_row(key, shown(job.get(key)))
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


def ride_out(exc: APIError, since: float | None) -> float:
    """A follower lost the server: wait a second and let it try again, for up to 30 s of trying (a server
    restarting); anything else, or longer, is raised. Returns when the trouble began."""
    if exc.status_code != 0:
        raise exc
    since = since or time.monotonic()
    if time.monotonic() - since > 30:
        raise exc
    time.sleep(1.0)
    return since


def follow(client: Client, job_id: int, on_change: Callable[[dict], None]) -> dict:
    """Follow the job's event stream until it ends, calling on_change(job) after each event; the
    ended job. A dropped connection is picked up again where it stopped (Last-Event-ID)."""
    job: dict | None = None
    failures_since, last_id = None, None
    while True:
        try:
            for ev in client.events(job_id, last_id):
                failures_since, last_id = None, ev.get("id") or last_id
                if ev["event"] == "state":
                    job = ev["data"]
                elif ev["event"] == "epoch" and job is not None:
                    metrics = ev["data"]
                    job = {**job, "latest_metrics": metrics, "progress": {**job["progress"], "epoch": metrics["epoch"]}}
                elif ev["event"] == "end":
                    job = client.get(job_id)
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


# -- sweeps ---------------------------------------------------------------------------------------

SWEEP_STATE_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan"}
TRIAL_STATE_STYLE = {**SWEEP_STATE_STYLE, "pruned": "yellow", "queued": "dim"}


def number(v) -> str:
    """A metric or parameter value, short: 4 significant digits for floats, JSON for lists."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return escaped(v)  # a choice's string: the client's


def params_text(params: dict) -> str:
    return ", ".join(f"{k}={number(v)}" for k, v in params.items())


def trial_state(t: dict) -> str:
    """A trial's state, or why it failed: a pruned trial is a failed job whose error class is "pruned"."""
    if t["state"] != JobState.FAILED or not t.get("failure"):
        return t["state"]
    return "pruned" if t["failure"] == "pruned" else f"failed ({t['failure']})"


def counts_text(counts: dict) -> str:
    order = ("succeeded", "pruned", "failed", "cancelled", "running", "queued")
    return ", ".join(f"{counts[k]} {k}" for k in (*order, *sorted(set(counts) - set(order))) if counts.get(k))


def sweep_line(sweep: dict) -> Text:
    """One line: id, name, state, trials made of max_trials, the counts, the best value so far."""
    best, counts = sweep.get("best"), counts_text(sweep.get("counts") or {})
    metric = f"{sweep['metric']} ({sweep.get('direction') or '?'})"
    made = f"{sweep.get('trial_count') or 0}/{sweep.get('max_trials') or '?'}"
    return Text.assemble(f"sweep {sweep['id']}", f" {escaped(sweep['name'])}" if sweep.get("name") else "", "  ",
                         (sweep["state"], SWEEP_STATE_STYLE.get(sweep["state"], "")),
                         f"  {sweep['method']}  {made} trials", f" ({counts})" if counts else "",
                         f"  {metric}: best {number(best['value'])} (trial {best['trial']})" if best
                         else f"  {metric}: no best yet")


def epoch_text(t: dict) -> str:
    if t.get("epochs"):
        return f"{t.get('epoch') or 0}/{t['epochs']}"
    return str(t["epoch"]) if t.get("epoch") else "-"


def trials_table(sweep: dict, trials: list[dict]) -> Table:
    """trial, job, state (or why it failed), each parameter, the metric, epoch/epochs, the best marked."""
    names = list((sweep.get("spec") or {}).get("parameters") or {})
    for t in trials:  # parameters the spec does not name (none, normally) still get a column
        names += [k for k in t.get("params") or {} if k not in names]
    # The sweep's own best: a trial's flag is as fresh as the last event about that trial.
    best = (sweep.get("best") or {}).get("trial")
    table = Table("trial", "job", "state", *map(shown, names), sweep["metric"], "epoch", "best")
    for t in sorted(trials, key=lambda t: t["trial"]):
        state = trial_state(t)
        is_best = t["trial"] == best if best is not None else bool(t.get("best"))
        params = t.get("params") or {}
        table.add_row(str(t["trial"]), str(t.get("job_id") or "-"),
                      Text(state, TRIAL_STATE_STYLE.get(state.split(" ")[0], "")),
                      *[Text(number(params.get(k))) for k in names],  # Text: a value is never read as markup
                      number(t.get("value")), epoch_text(t), Text("*", "bold green") if is_best else "")
    return table


def sweep_view(sweep: dict, trials: list[dict]) -> Group:
    return Group(sweep_line(sweep), trials_table(sweep, trials))


def sweep_summary(sweep: dict) -> None:
    """A sweep and its trials (if it has any yet), then its best trial."""
    trials = sweep.get("trials") or []
    console.print(sweep_view(sweep, trials) if trials else sweep_line(sweep))
    say_best(sweep)


def say_best(sweep: dict) -> None:
    best = sweep.get("best")
    if best:
        console.print(f"best trial {best['trial']} (job {best['job_id']}): {sweep['metric']} {number(best['value'])}"
                      f"  {escaped(params_text(best['params']))}", highlight=False, markup=False)
    elif sweep["state"] in TERMINAL:
        console.print(f"sweep {sweep['id']} {sweep['state']} without a best trial", highlight=False)


def say_sweep_failure(sweep: dict) -> None:
    if sweep["state"] == "failed":
        err.print(f"sweep {sweep['id']} failed: {escaped(sweep.get('error') or 'no trial succeeded')}", style="red",
                  markup=False, highlight=False)
    elif sweep["state"] == "cancelled":
        err.print(f"sweep {sweep['id']} was cancelled", style="yellow", highlight=False)


def follow_sweep(client: Client, sweep_id: int, on_change: Callable[[dict, list[dict]], None]) -> dict:
    """Follow the sweep's event stream until it ends, calling on_change(sweep, trials) after each event; the
    ended sweep, with its trials. After a dropped connection the sweep is read again whole and the stream
    opened again (it starts with every trial as it stands)."""
    failures_since = None
    while True:
        try:
            sweep = client.sweep(sweep_id)
            trials = {t["trial"]: t for t in sweep.get("trials") or []}
            on_change(sweep, list(trials.values()))
            if sweep["state"] in TERMINAL:
                return sweep
            for ev in client.sweep_events(sweep_id):
                failures_since = None
                if ev["event"] == "sweep":
                    sweep = {**sweep, **ev["data"]}
                elif ev["event"] == "trial":
                    trials[ev["data"]["trial"]] = ev["data"]
                elif ev["event"] == "end":
                    sweep = client.sweep(sweep_id)
                    on_change(sweep, sweep.get("trials") or [])
                    return sweep
                on_change(sweep, list(trials.values()))
            time.sleep(0.5)  # the stream closed before the end (a server restarting): read the sweep again
        except APIError as exc:
            failures_since = ride_out(exc, failures_since)


def follow_sweep_table(client: Client, sweep_id: int) -> dict:
    """A live table of the sweep's trials (on stderr) until the sweep ends; the ended sweep."""
    from rich.live import Live

    with Live(console=err, auto_refresh=True, refresh_per_second=4, transient=False) as live:
        sweep = follow_sweep(client, sweep_id, lambda s, ts: live.update(sweep_view(s, ts)))
    say_sweep_failure(sweep)
    return sweep
