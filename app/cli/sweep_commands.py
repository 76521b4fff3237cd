"""Client commands about sweeps: sweep, sweeps, sweep-status, sweep-watch, sweep-cancel, sweep-delete."""
from rich.table import Table

from trainyard.app.cli.calls import by_id, read_json
from trainyard.app.cli.job_commands import said_deleted
from trainyard.app.cli.output import console, number, show, shown, state_text
from trainyard.app.cli.sweep_output import counts_text, follow_sweep, follow_sweep_table, say_best, sweep_summary
from trainyard.app.client import TERMINAL, Client
from trainyard.app.core.states import SweepState


def add_sweep_commands(add) -> None:
    """The sweep commands' parsers, through the client commands' `add` (commands.py)."""
    sw = add("sweep", cmd_sweep, "start a hyperparameter sweep from a JSON file ('-' for stdin)")
    sw.add_argument("file", help="the sweep's spec, as POST /sweeps takes it ('-': read it from stdin)")
    sw.add_argument("--follow", action="store_true", help="show a live table of its trials until it ends, then "
                                                          "its best trial")
    sl = add("sweeps", cmd_sweeps, "list sweeps, newest first")
    sl.add_argument("--state", help=f"only sweeps in this state ({', '.join(SweepState)})")
    sl.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    for name, fn, help in (("sweep-status", by_id(lambda c, i: c.sweeps.get(i), sweep_summary),
                            "show a sweep and its trials"),
                           ("sweep-watch", cmd_sweep_watch, "show a sweep's live table of trials until it ends"),
                           ("sweep-cancel", by_id(lambda c, i: c.sweeps.cancel(i), sweep_summary),
                            "cancel a sweep and its unfinished trials")):
        add(name, fn, help).add_argument("id", type=int, help="the sweep's id (`trainyard sweeps` lists them)")
    sd = add("sweep-delete", cmd_sweep_delete, "delete an ended sweep and its trials' jobs (their files too)")
    sd.add_argument("id", type=int, help="the sweep's id (`trainyard sweeps` lists them)")
    sd.add_argument("--keep", choices=["best"], help="best: keep the best trial's job")


def cmd_sweep(client: Client, args) -> int:
    sweep = client.sweeps.submit(read_json(args.file, "sweep"))
    if not args.follow:
        show(sweep, args.json, sweep_summary)
        return 1 if sweep["state"] in TERMINAL and sweep["state"] != SweepState.SUCCEEDED else 0
    return watch_sweep(client, sweep["id"], args.json)


def cmd_sweep_delete(client: Client, args) -> int:
    best = client.sweeps.get(args.id).get("best") if args.keep else None
    client.sweeps.delete(args.id, keep=args.keep)
    show({"deleted": args.id, "kept": (best or {}).get("job_id")}, args.json, said_deleted("sweep"))
    return 0


def cmd_sweep_watch(client: Client, args) -> int:
    return watch_sweep(client, args.id, args.json)


def watch_sweep(client: Client, sweep_id: int, as_json: bool) -> int:
    """The live table until the sweep ends, then its best trial (under --json: nothing until the ended sweep);
    0 only when the sweep succeeded."""
    if as_json:
        sweep = follow_sweep(client, sweep_id, lambda sweep, trials: None)
    else:
        sweep = follow_sweep_table(client, sweep_id)
    show(sweep, as_json, say_best)  # the table stays on stderr: stdout gets only the answer
    return 0 if sweep["state"] == SweepState.SUCCEEDED else 1



def cmd_sweeps(client: Client, args) -> int:
    page = client.sweeps.list(state=args.state, limit=args.limit)

    def render(page: dict) -> None:
        t = Table("id", "name", "state", "method", "metric", "trials", "counts", "best", "created")
        for s in page["data"]:
            best = s.get("best")
            t.add_row(str(s["id"]), shown(s.get("name") or ""), state_text(s["state"]), s["method"],
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
