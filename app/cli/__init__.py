"""The `trainyard` command: run the server and workers (launch.py), talk to the API (commands.py), and check
a GPU host (gpu_check.py: `trainyard gpu-check`).

Human-readable output by default, `--json` for scripts. Client commands talk to TRAINYARD_URL
(or --url) and send TRAINYARD_API_TOKEN (or --token) as a bearer token.
"""
import argparse

from trainyard.app.cli import commands, gpu_check, launch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainyard", description="Run PyTorch training and inference jobs on your "
                                                              "GPU machines, over REST.")
    sub = p.add_subparsers(dest="command", required=True)
    launch.add_commands(sub)
    commands.add_commands(sub)
    gpu_check.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)

