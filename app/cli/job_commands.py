"""Client commands about jobs: submit, watch, status, cancel, retry, delete, pin, unpin, jobs, logs, result,
metrics, download; and upload (a dataset for jobs to train on)."""
import json
import sys
import time

from rich.table import Table

from trainyard.app.cli.calls import LocalError, by_id, read_json
from trainyard.app.cli.job_output import (
    follow_bar,
    follow_lines,
    job_table,
    metrics_table,
    progress_text,
    result_view,
    say_failure,
)
from trainyard.app.cli.output import TerminalWriter, console, err, show, shown, state_text
from trainyard.app.client import TERMINAL, Client
from trainyard.app.core.layout import ARTIFACT_FILES, EXPORT_FILES
from trainyard.app.core.states import JobState

# After a log was trimmed under a follower, it goes on from this many of the latest bytes.
FOLLOW_AFTER_TRIM = 64 << 10
# What GET /jobs/{id}/artifact serves: the trained files, then the exports made on request.
DOWNLOAD_FORMATS = (*ARTIFACT_FILES, *EXPORT_FILES)
JOB_ID = {"type": int, "help": "the job's id (`trainyard jobs` lists them)"}


def add_job_commands(add) -> None:
    """The job commands' parsers, through the client commands' `add` (commands.py)."""
    s = add("submit", cmd_submit, "submit a job from a JSON file ('-' for stdin)")
    s.add_argument("file", help="the job's spec, as POST /jobs takes it ('-': read it from stdin)")
    s.add_argument("--wait", action="store_true", help="wait until the job ends")
    s.add_argument("--follow", action="store_true", help="show a live progress bar until the job ends")
    j = add("jobs", cmd_jobs, "list jobs, newest first")
    j.add_argument("--state", help=f"only jobs in this state ({', '.join(JobState)})")
    j.add_argument("--kind", help="only jobs of this kind (train, predict, run)")
    j.add_argument("--limit", type=int, default=50, help="at most this many (default: 50)")
    for name, fn, help in (("status", by_id(lambda c, i: c.jobs.get(i), job_table), "show a job"),
                           ("cancel", by_id(lambda c, i: c.jobs.cancel(i), job_table), "cancel a job"),
                           ("retry", by_id(lambda c, i: c.jobs.retry(i), job_table),
                            "requeue a failed, cancelled or pruned job"),
                           ("delete", by_id(deleted, said_deleted("job")),
                            "delete an ended job: its metrics, model, checkpoints and log"),
                           ("pin", by_id(lambda c, i: c.jobs.pin(i), job_table), "keep a job from deletion"),
                           ("unpin", by_id(lambda c, i: c.jobs.unpin(i), job_table), "let a pinned job be deleted"),
                           ("watch", cmd_watch, "show a job's live progress until it ends"),
                           ("result", by_id(lambda c, i: c.jobs.result(i), result_view),
                            "print all of a succeeded job's result (a predict job's predictions)")):
        add(name, fn, help).add_argument("id", **JOB_ID)
    m = add("metrics", cmd_metrics, "print a job's metrics, one row per epoch")
    m.add_argument("id", **JOB_ID)
    m.add_argument("--since", type=int, default=0, metavar="EPOCH", help="only the epochs after this one")
    lg = add("logs", cmd_logs, "print a job's log")
    lg.add_argument("id", **JOB_ID)
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    lg.add_argument("--tail", type=int, metavar="BYTES", help="only the log's last BYTES (from a line's start)")
    d = add("download", cmd_download, "download a job's model: its state_dict, its meta.json, or an export")
    d.add_argument("id", **JOB_ID)
    d.add_argument("-o", "--output", required=True, help="the file to write (whole, or not at all)")
    d.add_argument("--format", choices=DOWNLOAD_FORMATS, default="safetensors",
                   help=f"the state_dict ({', '.join(f for f in ARTIFACT_FILES if f != 'meta')}), its meta.json "
                        f"(meta), or the model exported ({', '.join(EXPORT_FILES)}: made on the first request)")
    up = add("upload", cmd_upload, "upload a dataset (.csv, .npz, ImageFolder .zip)")
    up.add_argument("file", help="the dataset's file")
    up.add_argument("--label-column", help="CSV: the column of class labels")


def deleted(client: Client, job_id: int) -> dict:
    client.jobs.delete(job_id)
    return {"deleted": job_id}


def said_deleted(noun: str):
    """What `delete` and `sweep-delete` show: the id deleted (and the job kept)."""
    def render(d: dict) -> None:
        kept = f" (kept job {d['kept']}, its best trial)" if d.get("kept") else ""
        console.print(f"deleted {noun} {d['deleted']}{kept}")
    return render


def cmd_submit(client: Client, args) -> int:
    job: dict = client.jobs.submit(read_json(args.file, "job"))
    # Under --json, stderr stays for errors: the ended job on stdout says how it ended.
    if args.follow and not args.json:
        job = follow_bar(client, job["id"])
    elif args.follow or args.wait:
        job = follow_lines(client, job["id"], quiet=args.json)
        if not args.json:
            say_failure(job)
    show(job, args.json, job_table)
    return 1 if job["state"] in TERMINAL and job["state"] != JobState.SUCCEEDED else 0


def cmd_watch(client: Client, args) -> int:
    job = follow_lines(client, args.id, quiet=True) if args.json else follow_bar(client, args.id)
    show(job, args.json, job_table)
    return 0 if job["state"] == JobState.SUCCEEDED else 1


def cmd_metrics(client: Client, args) -> int:
    show(client.jobs.metrics(args.id, since=args.since), args.json, metrics_table)
    return 0


def cmd_jobs(client: Client, args) -> int:
    page = client.jobs.list(state=args.state, kind=args.kind, limit=args.limit)

    def render(page: dict) -> None:
        t = Table("id", "kind", "name", "state", "device", "progress", "created")
        for j in page["data"]:
            ranks = j.get("ranks") or []
            across = len({r.get("host") for r in ranks}) > 1  # a job across hosts: each rank's host too
            ran = " + ".join(f"{r['device']}@{r['host']}" if across else r["device"] for r in ranks) or j["device"]
            t.add_row(str(j["id"]), j["kind"], shown(j["name"] or ""), state_text(j["state"]),
                      shown(ran or j["requested_device"]),
                      progress_text(j), j["created_at"][:19])
        console.print(t)
        console.print(f"{len(page['data'])} of {page['count']} jobs")

    show(page, args.json, render)
    return 0


def cmd_logs(client: Client, args) -> int:
    """The log so far (or its last --tail bytes); with -f, what the job prints next until it ends, each
    read asking only for the bytes after the last one's."""
    if args.tail is not None and args.tail < 1:
        raise LocalError("trainyard logs: --tail must be at least 1")
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
