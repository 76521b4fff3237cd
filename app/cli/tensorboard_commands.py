"""`trainyard tensorboard`: download jobs' TensorBoard event files (GET /jobs/{id}/tensorboard, a sweep's trials'
with --sweep) into one folder, a subfolder per job named by its id, and open TensorBoard on it; where TensorBoard is
not installed (or with --no-launch, or --json), say the folder and the command to run instead."""
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from trainyard.app.cli.calls import LocalError
from trainyard.app.cli.output import console, err
from trainyard.app.client import APIError, Client
from trainyard.app.client.http import describe


def add_tensorboard_commands(add) -> None:
    """The command's parser, through the client commands' `add` (commands.py)."""
    t = add("tensorboard", cmd_tensorboard, "download jobs' TensorBoard event files (or a sweep's trials') and "
                                            "open TensorBoard on them")
    t.add_argument("ids", nargs="*", type=int, metavar="JOB_ID", help="the jobs (`trainyard jobs` lists them)")
    t.add_argument("--sweep", type=int, action="append", default=[], metavar="ID",
                   help="every trial of this sweep too (may be given again)")
    t.add_argument("--dir", help="the folder to download into, a subfolder per job (default: a new temporary one)")
    t.add_argument("--port", type=int, help="TensorBoard's port (default: its own, 6006)")
    t.add_argument("--no-launch", action="store_true",
                   help="download only: print the folder and the command that opens it")


def cmd_tensorboard(client: Client, args) -> int:
    ids = list(dict.fromkeys([*args.ids, *(t["job_id"] for s in args.sweep for t in client.sweeps.trials(s))]))
    if not ids:
        raise LocalError("trainyard tensorboard: name a job (JOB_ID) or a sweep (--sweep ID)")
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="trainyard-tensorboard-"))
    got, missing = download(client, ids, folder)
    if not got:
        raise LocalError(f"trainyard tensorboard: no event files to show ({'; '.join(missing.values())})")
    command = ["tensorboard", "--logdir", str(folder), *(["--port", str(args.port)] if args.port else [])]
    if args.json:
        print(json.dumps({"dir": str(folder), "jobs": got, "missing": missing, "command": command}))
        return 0
    err.print(f"event files of job{'s' if len(got) > 1 else ''} {', '.join(map(str, got))} in {folder}",
              highlight=False)
    for detail in missing.values():
        err.print(f"  left out: {detail}", highlight=False)
    program = shutil.which("tensorboard")
    if args.no_launch or program is None:
        why = "" if program else " (tensorboard is not installed here: pip install tensorboard)"
        console.print(f"to open them{why}:\n  {' '.join(command)}", highlight=False)
        return 0
    try:
        return subprocess.call([program, *command[1:]])
    except KeyboardInterrupt:  # Ctrl-C stops TensorBoard (it got the signal too): the usual way to leave
        return 0


def download(client: Client, ids: list[int], folder: Path) -> tuple[list[int], dict[int, str]]:
    """Each job's event files into folder/<id>/: (the jobs downloaded, {job: why not} for those with none or
    none to see). Any other refusal ends the command."""
    got: list[int] = []
    missing: dict[int, str] = {}
    for job_id in ids:
        try:
            client.jobs.tensorboard(job_id, folder)
            got.append(job_id)
        except APIError as exc:
            if exc.status_code != 404:
                raise
            missing[job_id] = describe(exc.detail)
    return got, missing
