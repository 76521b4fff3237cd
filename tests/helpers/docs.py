"""The code blocks of the docs, run as a reader would paste them."""
import subprocess
import sys


def run_block(lang: str, code: str, cwd, timeout: float = 60) -> subprocess.CompletedProcess:
    """A `sh` block under bash -euo pipefail, any other under this Python."""
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
