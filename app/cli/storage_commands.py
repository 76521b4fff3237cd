"""Client commands about the store: `storage` (what it holds by kind, and the retention rules) and `storage
collect` (a pass of the collector now)."""
from rich.table import Column, Table

from trainyard.app.cli.output import console, show, shown
from trainyard.app.client import Client

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def add_storage_commands(add) -> None:
    """The storage commands' parser, through the client commands' `add` (commands.py)."""
    sp = add("storage", cmd_storage, "show what the store holds by kind and the retention rules "
                                     "(`storage collect`: run the collector now)")
    sp.add_argument("action", nargs="?", choices=["collect"],
                    help="collect: apply the retention rules and remove every object no job references, now")


def cmd_storage(client: Client, args) -> int:
    if args.action == "collect":
        show(client.storage.collect(), args.json, collection_text)
    else:
        show(client.storage.get(), args.json, storage_text)
    return 0


def size(n: float | None) -> str:
    """Bytes for people: 1.5 GiB, 320 KiB, 12 B."""
    if n is None:
        return "-"
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def duration(s: float) -> str:
    """A rule's duration: 0 keeps for ever; else in its largest whole unit (7 d, 10 min, 90 s)."""
    if not s:
        return "0 (kept for ever)"
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= length and s % length == 0:
            return f"{s / length:.0f} {unit}"
    return f"{s:g} s"


def kinds_table(kinds: dict[str, dict[str, int]]) -> Table:
    """Each kind's size and objects (cache: this host's copies of a bucket's objects, not more of the store)."""
    t = Table("kind", Column("size", justify="right"), Column("objects", justify="right"))
    for kind, u in kinds.items():
        t.add_row(shown(kind), size(u["bytes"]), str(u["objects"]))
    return t


def rules_table(rules: dict) -> Table:
    t = Table("rule", "value")
    for name, value in rules.items():
        if name.endswith("_s"):
            shown_value = duration(value)
        elif name.endswith("_bytes"):
            shown_value = size(value)
        else:
            shown_value = str(value)
        t.add_row(name, shown_value)
    return t


def storage_text(s: dict) -> None:
    at = s.get("measured_at")  # ISO 8601, UTC
    measured = f"measured {at[:19].replace('T', ' ')} UTC" if at else "not measured yet: the collector has not run"
    project = s.get("project")
    if project:  # a member's answer: their project's part of the store only
        console.print(f"project {shown(project['name'])}: {size(project['bytes'])} in {project['objects']} objects  "
                      f"({measured})")
    else:
        console.print(f"store: {shown(s['store'])}  ({measured})")
        console.print(kinds_table(s["kinds"]))
    console.print(rules_table(s["rules"]))


def collection_text(c: dict) -> None:
    console.print(f"collected in {c['took_s']:.2f} s: removed {c['deleted_objects']} objects "
                  f"({size(c['deleted_bytes'])}) no job references; {c['checkpoints_dropped']} checkpoints dropped, "
                  f"{c['jobs_deleted']} jobs deleted, {c['trials_reclaimed']} sweep trials reclaimed, "
                  f"{c['evicted_objects']} cached copies evicted")
    console.print(kinds_table(c["usage"]))
