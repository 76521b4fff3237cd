"""The `trainyard` command: run the server and workers (launch.py), talk to the API (commands.py), and check
a GPU host (gpu_check.py: `trainyard gpu-check`).

Human-readable output by default, `--json` for scripts: then every error, a mistyped argument too, is JSON on
stderr (output.py says its shape) with a non-zero exit. Client commands talk to TRAINYARD_URL (or --url) and
send TRAINYARD_API_TOKEN (or --token) as a bearer token.
"""
import argparse
import sys
from typing import NoReturn

from pydantic import ValidationError

from trainyard.app import __version__
from trainyard.app.cli import commands, gpu_check, launch, slurm_commands
from trainyard.app.cli.output import fail


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """The parser; with json_errors, one that says a mistyped command line as JSON (the command asked for
    --json, which argparse has not read yet when the line is wrong)."""
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            if not json_errors:
                super().error(message)
            self.exit(fail(f"{self.prog}: {message}", as_json=True))

    p = Parser(prog="trainyard", description="Run PyTorch training and inference jobs on your GPU machines, "
                                             "over REST.")
    p.add_argument("--version", action="version", version=f"trainyard {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    launch.add_commands(sub)
    commands.add_commands(sub)
    gpu_check.add_commands(sub)
    slurm_commands.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(json_errors="--json" in argv).parse_args(argv)
    try:
        return args.fn(args)
    except ValidationError as exc:
        if exc.title != "Settings":
            raise
        # A TRAINYARD_* variable the settings refuse: its name and why, not a traceback.
        lines = [f"TRAINYARD_{'_'.join(map(str, e['loc'])).upper()}: {e['msg'].removeprefix('Value error, ')}"
                 for e in exc.errors()]
        raise SystemExit("trainyard: a setting is refused:\n  " + "\n  ".join(lines)) from None
