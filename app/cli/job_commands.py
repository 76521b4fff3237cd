"""Client commands about jobs: submit, watch, status, cancel, retry, jobs, logs, download; and upload (a
dataset for jobs to train on)."""
import json
import sys
import time

from rich.table import Table

from trainyard.app.cli.calls import by_id, read_json
from trainyard.app.cli.job_output import follow_bar, follow_lines, job_table, progress_text, say_failure
from trainyard.app.cli.output import TerminalWriter, console, err, show, shown
from trainyard.app.client import TERMINAL, Client
from trainyard.app.states import JobState

# After a log was trimmed under a follower, it goes on from this many of the latest bytes.
FOLLOW_AFTER_TRIM = 64 << 10


def add_job_commands(add) -> None:
    """The job commands' parsers, through the client commands' `add` (commands.py)."""
    s = add("submit", cmd_submit, "submit a job from a JSON file ('-' for stdin)")
    s.add_argument("file")
    s.add_argument("--wait", action="store_true", help="wait until the job ends")
    s.add_argument("--follow", action="store_true", help="show a live progress bar until the job ends")
    j = add("jobs", cmd_jobs, "list jobs, newest first")
    j.add_argument("--state")
    j.add_argument("--kind")
    j.add_argument("--limit", type=int, default=50)
    for name, fn, help in (("status", by_id(lambda c, i: c.jobs.get(i), job_table), "show a job"),
                           ("cancel", by_id(lambda c, i: c.jobs.cancel(i), job_table), "cancel a job"),
                           ("retry", by_id(lambda c, i: c.jobs.retry(i), job_table),
                            "requeue a failed or cancelled job"),
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
    up = add("upload", cmd_upload, "upload a dataset (.csv, .npz, ImageFolder .zip)")
    up.add_argument("file")
    up.add_argument("--label-column", help="CSV: the column of class labels")


def cmd_submit(client: Client, args) -> int:
    body = read_json(args.file, "job")
    if body is None:
        return 2
    job: dict = client.jobs.submit(body)
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




def cmd_jobs(client: Client, args) -> int:
    page = client.jobs.list(state=args.state, kind=args.kind, limit=args.limit)

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
    data, start, _size = client.jobs.read_log(args.id, tail=args.tail)
    while True:
        out.write(data)
        out.flush()
        offset = start + len(data)
        if not args.follow:
            return 0
        ended = client.jobs.get(args.id)["state"] in TERMINAL
        data, start, size = client.jobs.read_log(args.id, offset=offset)
        if size < offset:  # trimmed to its cap while we read: go on from its latest lines
            data, start, size = client.jobs.read_log(args.id, tail=FOLLOW_AFTER_TRIM)
            out.write(b"\n[trainyard logs: the log was trimmed to its cap here]\n")
        if ended and not data:
            return 0
        if not data:
            time.sleep(0.5)


def cmd_download(client: Client, args) -> int:
    out = client.jobs.download(args.id, args.output, args.format)
    size = out.stat().st_size
    if args.json:
        print(json.dumps({"path": str(out), "bytes": size}))
    else:
        err.print(f"wrote {out} ({size} bytes)", highlight=False)
    return 0


def cmd_upload(client: Client, args) -> int:
    def render(d: dict) -> None:
        console.print(f"uploaded {shown(d['name'])} as {d['dataset']}: {d['samples']} samples of shape "
                      f"{d['input_shape']}, {len(d['classes'])} classes")

    show(client.datasets.upload(args.file, args.label_column), args.json, render)
    return 0
