"""How a client command runs: its Client, a failed request or a local error as the exit code, a JSON file it
reads, and the commands that read (or change) one thing by its id and show the answer."""
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.app.cli.output import error, fail, show
from trainyard.app.client import APIError, Client

Command = Callable[[Client, Any], int]


class LocalError(Exception):
    """What a command found wrong before or beside any request (a file it cannot read, an argument out of
    range): said like a refused request (JSON under --json), exit code 2."""


def run(fn: Command, args) -> int:
    with Client(url=args.url, token=args.token) as client:
        try:
            return fn(client, args)
        except APIError as exc:
            return error(exc, args.json)
        except LocalError as exc:
            return fail(str(exc), args.json)
        except OSError as exc:  # a file to upload, or a download's folder: named by the OSError itself
            return fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc), args.json)


def read_json(path: str, what: str):
    """The JSON in a file ('-': stdin); LocalError when it cannot be read."""
    try:
        return json.loads(Path(path).read_text()) if path != "-" else json.load(sys.stdin)
    except (OSError, ValueError) as exc:
        raise LocalError(f"cannot read a JSON {what} from {path}: {exc}") from None


def by_id(call: Callable[[Client, Any], Any], render: Callable[[Any], None], key: str = "id") -> Command:
    """A command that calls the API on one thing, named by the argument `key` (a job's or sweep's id, a
    worker's), and shows the answer: `status`, `cancel`, `drain`, `sweep-status` and the like."""
    def command(client: Client, args) -> int:
        show(call(client, getattr(args, key)), args.json, render)
        return 0
    return command
