"""Names on the operator's terminal: control characters in job and sweep names are refused at submit, and
the CLI prints what clients chose (names stored before that check, Rich markup) as text, never as
escape sequences the terminal acts on or as markup; `trainyard logs` keeps a log's colours only."""
import re
import sqlite3
import subprocess
import sys

from tests.helpers.service import ROOT, live_service
from trainyard.app.spec import TRAIN_EXAMPLE

# ESC ] 52 writes the clipboard, ESC ] 0 the window title, ESC [ 2J clears the screen, U+202E reverses
# what follows; and Rich markup that would print as a hyperlink.
EVIL = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b]0;pwned\x1b\\\x1b[2J\u202e[link=http://evil.example]click[/link]"
SHOWN = r"\x1b]52;c;cm0gLXJmIH4=\x07\x1b]0;pwned\x1b\\x1b[2J\u202e[link=http://evil.example]click[/link]"
# What a terminal would act on, colours (SGR: ESC [ ... m) aside: any other ESC, or an 8-bit CSI/OSC.
ACTING = re.compile(r"\x1b(?!\[[0-9;]*m)|[\x80-\x9f]")
QUEUED = {**TRAIN_EXAMPLE, "device": "cuda:7"}  # no worker here: it stays queued


live = live_service(workers=0)


def cli(svc, *args: str) -> bytes:
    """The real `trainyard` command's stdout and stderr, as bytes, with Rich sure it writes to a colour terminal."""
    env = {**svc.env, "COLUMNS": "250", "TERM": "xterm-256color", "FORCE_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "trainyard", *args], cwd=ROOT, env=env, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def rename(svc, table: str, row_id: int, name: str) -> None:
    """Set a name as a server before the submit check could have stored it."""
    with sqlite3.connect(svc.data_dir / "trainyard.db") as db:
        assert db.execute(f"UPDATE {table} SET name = ? WHERE id = ?", (name, row_id)).rowcount == 1


def test_control_characters_in_names_are_refused_at_submit(live):
    sweep = {"job": QUEUED, "method": "random", "max_trials": 1,
             "parameters": {"train.lr": {"type": "float", "low": 0.001, "high": 0.1}}}
    with live.client() as c:
        r = c.post("/jobs", json={**QUEUED, "name": "a\x1b]52;c;eA==\x07"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"], r.text
        assert r"control character \x1b at 1" in r.json()["detail"][0]["msg"]
        r = c.post("/sweeps", json={**sweep, "name": "\x1b[2J"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"], r.text
        r = c.post("/sweeps", json={**sweep, "parameters": {"train.lr\u202e": sweep["parameters"]["train.lr"]}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", "parameters"], r.text
        assert c.post("/jobs", json={**QUEUED, "name": "[bold]markup[/bold] is text, not refused"}).status_code == 201


def test_the_cli_prints_names_as_text(live):
    job_id = live.submit({**QUEUED, "name": "placeholder"})["id"]
    rename(live, "jobs", job_id, EVIL)
    with live.client() as c:
        sweep_id = c.post("/sweeps", json={
            "name": "placeholder", "job": QUEUED, "method": "grid",
            "parameters": {"train.lr": {"type": "choice", "values": [0.01]}}}
        ).raise_for_status().json()["id"]
    rename(live, "sweeps", sweep_id, EVIL)
    for args in (("status", str(job_id)), ("jobs",), ("sweeps",), ("sweep-status", str(sweep_id))):
        out = cli(live, *args).decode()
        assert not ACTING.search(out), (args, out)  # no clipboard, title, clear screen, hyperlink (ESC ] 8)
        text = re.sub(r"\x1b\[[0-9;]*m", "", out)
        assert SHOWN in text, (args, text)  # the name, its control characters as escapes and its markup as text


def test_logs_keep_their_colours_only(live):
    job_id = live.submit({**QUEUED, "name": "logs"})["id"]
    log = live.data_dir / "logs" / f"{job_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"epoch 1 \x1b[32mok\x1b[0m\n\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x1b]0;title\x1b\\"
                    b"\x1b]8;;http://evil.example\x1b\\link\x1b]8;;\x1b\\\r\xc2\x9b2Jdone\n")
    env = {**live.env, "TERM": "xterm-256color"}
    r = subprocess.run([sys.executable, "-m", "trainyard", "logs", str(job_id)], cwd=ROOT, env=env,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"epoch 1 \x1b[32mok\x1b[0m\nlink\r2Jdone\n"
