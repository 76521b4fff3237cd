"""Client commands, which talk to the API: their common options (--json, --url, --token) and their parsers,
each group in its own module: job_commands.py (submit, jobs, status, watch, logs, result, metrics, cancel,
retry, download, upload), fleet_commands.py (devices, workers, drain, undrain), sweep_commands.py (sweep, sweeps,
sweep-status, sweep-watch, sweep-cancel), storage_commands.py (storage, storage collect), tensorboard_commands.py
(tensorboard), admin_commands.py (users, projects, audit, whoami)."""
import argparse
from typing import Any

from trainyard.app.cli.admin_commands import add_admin_commands
from trainyard.app.cli.calls import Command, run
from trainyard.app.cli.fleet_commands import add_fleet_commands
from trainyard.app.cli.job_commands import add_job_commands
from trainyard.app.cli.storage_commands import add_storage_commands
from trainyard.app.cli.sweep_commands import add_sweep_commands
from trainyard.app.cli.tensorboard_commands import add_tensorboard_commands


def client_options(parser: argparse.ArgumentParser, nested: bool = False) -> None:
    """--json, --url and --token. nested: on a command's own subcommand (`users add`), where they default to
    nothing, so that one given before the subcommand (`users --json add`) is kept."""
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if nested else {}
    parser.add_argument("--json", action="store_true", help="machine-readable output (errors too, on stderr)",
                        **default)
    parser.add_argument("--url", help="the API (default: TRAINYARD_URL or http://127.0.0.1:8000)", **default)
    parser.add_argument("--token", help="bearer token (default: TRAINYARD_API_TOKEN)", **default)


def add_commands(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    client_options(common)

    def add(name: str, fn: Command, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, parents=[common])
        sp.set_defaults(fn=lambda args: run(fn, args))
        return sp

    for add_group in (add_job_commands, add_fleet_commands, add_sweep_commands, add_storage_commands,
                      add_tensorboard_commands):
        add_group(add)
    add_admin_commands(add, lambda parser: client_options(parser, nested=True))
