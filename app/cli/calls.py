"""How a client command runs: its Client, a failed request as the exit code, a JSON file it reads, and the
commands that read (or change) one thing by its id and show the answer."""
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.app.cli.output import err, error, show
from trainyard.app.client import APIError, Client

Command = Callable[[Client, Any], int]


def run(fn: Command, args) -> int:
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


def by_id(call: Callable[[Client, Any], Any], render: Callable[[Any], None], key: str = "id") -> Command:
    """A command that calls the API on one thing, named by the argument `key` (a job's or sweep's id, a
    worker's), and shows the answer: `status`, `cancel`, `drain`, `sweep-status` and the like."""
    def command(client: Client, args) -> int:
        show(call(client, getattr(args, key)), args.json, render)
        return 0
    return command
