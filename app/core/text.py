"""Client text on terminals: the control characters a name may not carry (app/spec/ refuses them at
submit), and client text with them made visible (the CLI prints every client string so).

A terminal acts on what it is sent: ESC ] 52 sets the clipboard, ESC ] 0 the window title, ESC [ 2J
clears the screen, a bidi override reorders what follows. Torch-free and pydantic-free: the CLI
imports it on every run.
"""
import re

# C0 and C1 controls and DEL (ESC, and the 8-bit CSI and OSC), line and paragraph separators, bidi
# embeddings, overrides and isolates.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def first_control(text: str) -> str | None:
    """Where text's first control character is, said for an error message; None if it has none."""
    m = CONTROL_CHARS.search(text)
    return f"control character {escaped(m.group())} at {m.start()}" if m else None


def escaped(value: object) -> str:
    """str(value) with each control character written as its Python escape (ESC as the four characters \\x1b)."""
    return CONTROL_CHARS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))
