"""How the CLI shows things, the parts every command shares: JSON for scripts, rich consoles for people,
a failed request as an exit code, a job's log through TerminalWriter. A job's views are job_output.py's,
a sweep's sweep_output.py's.

Every string a client or a job chose (names, parameters, error messages, the server's words that may
quote them) is printed through shown() (markup read) or escaped() (Text, markup=False): its control
characters as escapes (\\x1b), so that a name cannot set the clipboard or clear the screen, and its Rich
markup as text, so that "[link=...]" is not a hyperlink. JSON output escapes control characters itself.
A job's log (`trainyard logs`) is its own output, printed as such through TerminalWriter: colours kept,
every other escape sequence taken out.

Off a terminal (a pipe, a file) nothing is wrapped or cut to a width: a script reads each line whole.
Under --json every error is one JSON object on stderr, {"error": {"status_code", "detail"}}, and the exit
code is not 0: status_code is the HTTP status, 0 when the server could not be reached, null for an error
before any request (a file that cannot be read, a bad argument). A followed job or sweep that failed is an
answer, not an error: on stdout, exit code 1, stderr left empty.
"""
import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from rich.console import Console
from rich.markup import escape
from rich.segment import Segment
from rich.text import Text

from trainyard.app.client import APIError, describe
from trainyard.app.core.states import JobState
from trainyard.app.core.text import escaped

# A width no line reaches: off a terminal, Rich would otherwise wrap text and cut table cells at 80 columns.
UNWRAPPED = 1_000_000
# The spaces that end a line (before any closing colour codes, where colour is forced off a terminal).
_TRAILING = re.compile(r" +(?=(?:\x1b\[[0-9;]*m)*$)", re.M)


class _Console(Console):
    """Rich's console, but off a terminal no line ends in spaces: a table pads every cell to its column's widest,
    and at the width of UNWRAPPED a key-value table's last column (a job's result) padded each line of
    `trainyard status` with hundreds of spaces."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:  # Rich's one place that turns output into text
        text = super()._render_buffer(buffer)
        return text if self.is_terminal else _TRAILING.sub("", text)


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # None, or closed
        tty = False
    return _Console(stderr=stderr, width=None if tty else UNWRAPPED)


console = _console(stderr=False)
err = _console(stderr=True)

# A state's colour (a job's, a sweep's, a trial's): a pruned trial was stopped early, not broken.
STATE_STYLE: dict[str, str] = {JobState.SUCCEEDED: "green", JobState.FAILED: "red", JobState.CANCELLED: "yellow",
                               JobState.PRUNED: "yellow", JobState.RUNNING: "cyan", JobState.QUEUED: "dim"}


def state_text(state: str) -> Text:
    """A job's or sweep's state in its colour (its first word: "failed (oom)" is red)."""
    return Text(escaped(state), STATE_STYLE.get(state.split(" ")[0], ""))


def shown(value: Any) -> str:
    """Client text for what reads Rich markup (console.print, a table's str cells): control characters as
    escapes, markup escaped. For Text() and markup=False prints: escaped()."""
    return escape(escaped(value))


# What in a log acts on the terminal: CSI sequences (kept only when they set colours: SGR, ending in
# "m"), OSC strings (the title, the clipboard, hyperlinks), DCS, SOS, PM and APC strings, any other
# escape, a lone ESC, the C0 controls but tab, newline and carriage return (progress bars), DEL, and
# the C1 controls (UTF-8 encoded: 8-bit CSI and OSC).
_LOG_SEQUENCE = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[ -/]*[0-~]"
                           rb"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\xc2[\x80-\x9f]")
# A sequence that the end of a read cut (an OSC string without its end, a CSI without its final byte, a
# lone ESC, the first byte of a C1 control) waits for the next read, up to _LOG_HELD_MAX bytes (beyond,
# its ESC goes and its text is printed as text).
_LOG_UNFINISHED = re.compile(rb"(?:\x1b[\]PX^_][^\x07\x1b]*\x1b?|\x1b\[[0-?]*[ -/]*|\x1b[ -/]*|\xc2)\Z")
_LOG_HELD_MAX = 4096


class TerminalWriter:
    """A job's log bytes to out (stdout's buffer) with the sequences that would act on the terminal taken
    out (colours kept); a sequence split across writes is held until it is whole."""

    def __init__(self, out: BinaryIO):
        self.out, self.held = out, b""

    def write(self, data: bytes) -> None:
        data = self.held + data
        unfinished = _LOG_UNFINISHED.search(data, max(0, len(data) - _LOG_HELD_MAX))
        cut = unfinished.start() if unfinished else len(data)
        self.held = data[cut:]
        self.out.write(_LOG_SEQUENCE.sub(lambda m: m.group() if m.group().endswith(b"m") and
                                         m.group().startswith(b"\x1b[") else b"", data[:cut]))

    def flush(self) -> None:
        self.out.flush()


def show(obj: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    if as_json:
        print(json.dumps(obj, indent=2))
    else:
        render(obj)


def fail(message: str, as_json: bool) -> int:
    """Report an error found before (or instead of) a request, on stderr; the exit code, 2."""
    if as_json:
        print(json.dumps({"error": {"status_code": None, "detail": message}}), file=sys.stderr)
    else:
        err.print(escaped(message), style="red", markup=False, highlight=False)
    return 2


def error(exc: APIError, as_json: bool) -> int:
    """Report a failed request on stderr; the exit code (2: unreachable, 1: refused)."""
    if as_json:
        print(json.dumps({"error": {"status_code": exc.status_code, "detail": exc.detail}}), file=sys.stderr)
    elif exc.status_code == 0:
        err.print(escaped(exc.detail), style="red", markup=False, highlight=False)
    else:
        # markup=False: the server's words are shown as sent ("[job]" or "[/x]" in them are not rich tags),
        # but for control characters (a 422 names the offending key of a sweep's parameters)
        err.print(f"error {exc.status_code}: {escaped(describe(exc.detail))}", style="red", markup=False,
                  highlight=False)
    return 2 if exc.status_code == 0 else 1


def number(v) -> str:
    """A metric or parameter value, short: 4 significant digits for floats, JSON for lists."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return escaped(v)  # a choice's string: the client's


def mib(n) -> str:
    return f"{n / 2**20:.1f} MiB" if n is not None else "-"



def ride_out(exc: APIError, since: float | None) -> float:
    """A follower lost the server: wait a second and let it try again, for up to 30 s of trying (a server
    restarting); anything else, or longer, is raised. Returns when the trouble began."""
    if exc.status_code != 0:
        raise exc
    since = since or time.monotonic()
    if time.monotonic() - since > 30:
        raise exc
    time.sleep(1.0)
    return since
