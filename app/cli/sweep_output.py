"""How the CLI shows a sweep: one line about it, a table of its trials (live while it runs, following its
event stream), and its best trial."""
import time
from collections.abc import Callable

from rich.console import Group
from rich.table import Table
from rich.text import Text

from trainyard.app.cli.output import console, err, number, ride_out, shown, state_text
from trainyard.app.client import TERMINAL, APIError, Client
from trainyard.app.core.states import JobState
from trainyard.app.core.text import escaped


def params_text(params: dict) -> str:
    return ", ".join(f"{k}={number(v)}" for k, v in params.items())


def trial_state(t: dict) -> str:
    """A trial's state, or why it failed (a pruned trial's job is `pruned`; before 0005, failed with class pruned)."""
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
                         state_text(sweep["state"]),
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
                      state_text(state),
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
            sweep: dict = client.sweeps.get(sweep_id)
            trials = {t["trial"]: t for t in sweep.get("trials") or []}
            on_change(sweep, list(trials.values()))
            if sweep["state"] in TERMINAL:
                return sweep
            for ev in client.sweeps.events(sweep_id):
                failures_since = None
                if ev["event"] == "sweep":
                    sweep = {**sweep, **ev["data"]}
                elif ev["event"] == "trial":
                    trials[ev["data"]["trial"]] = ev["data"]
                elif ev["event"] == "end":
                    sweep = client.sweeps.get(sweep_id)
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
