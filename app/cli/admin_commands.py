"""Client commands about accounts, for admins: `users` (list, add, set, delete, token, revoke), `projects` (list,
add, set, member-add, member-remove) and `audit`; and `whoami`, for anyone: who the token acts as."""
import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from rich.table import Table

from trainyard.app.cli.calls import LocalError
from trainyard.app.cli.output import console, show, shown
from trainyard.app.client import Client

LIMIT_KEYS = "devices, gpu_memory_gb, queued_jobs, running_sweeps, stored_bytes, max_priority"
DURATION = re.compile(r"(\d+)([smhd]?)")
UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def add_admin_commands(add, options: Callable[[Any], None]) -> None:
    """The account commands' parsers, through the client commands' `add` (commands.py); `options` gives a
    subcommand (`users add`) the common --json, --url and --token."""
    def group(name: str, help: str, actions: str):
        sub = add(name, lambda client, args: args.do(client, args), help).add_subparsers(
            dest="action", required=True, metavar="ACTION", help=actions)

        def leaf(action: str, fn, help: str):
            sp = sub.add_parser(action, help=help, description=help)
            options(sp)
            sp.set_defaults(do=fn)
            return sp
        return leaf

    users = group("users", "users and their tokens (admins)",
                  "list | add NAME | set NAME | delete NAME | token NAME | revoke TOKEN_ID")
    users("list", cmd_users, "list users, their projects and live tokens")
    ua = users("add", cmd_user_add, "add a user (in no project yet: `projects member-add`)")
    ua.add_argument("name", help="the user's name (lowercase letters, digits, '_', '.', '-')")
    ua.add_argument("--admin", action="store_true", help="an admin: sees and acts on every project, and accounts")
    us = users("set", cmd_user_set, "grant (--admin) or take back (--no-admin) a user's admin rights")
    us.add_argument("name", help="the user's name")
    us.add_argument("--admin", action=argparse.BooleanOptionalAction, required=True,
                    help="--no-admin also revokes their tokens that name no project")
    users("delete", cmd_user_delete, "delete a user: their tokens are refused at once, their memberships go, "
                                     "their jobs stay").add_argument("name", help="the user's name")
    ut = users("token", cmd_token, "issue a token for a user; it is shown once")
    ut.add_argument("name", help="the user's name")
    ut.add_argument("--project", help="the project its requests act in (required but for an admin's token)")
    ut.add_argument("--label", help="a note of where it is used")
    ut.add_argument("--expires", type=duration, metavar="DURATION",
                    help="it stops working after this long: 30d, 12h, 45m, or seconds (default: when revoked)")
    users("revoke", cmd_revoke, "revoke a token: it is refused from the next request on").add_argument(
        "token_id", type=int, help="the token's id, as `users list` shows it")

    projects = group("projects", "projects, their share, limits and members (admins)",
                     "list | add NAME | set NAME | member-add PROJECT USER | member-remove PROJECT USER")
    projects("list", cmd_projects, "list projects")
    for action, fn, help in (("add", cmd_project_add, "add a project"),
                             ("set", cmd_project_set, "change a project's share or limits")):
        sp = projects(action, fn, help)
        sp.add_argument("name", help="the project's name")
        sp.add_argument("--share", type=float, help="its weight in the fair share (default 1)")
        sp.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a limit ({LIMIT_KEYS}); `set` with KEY= removes it; repeat for several")
    for action, fn, help in (("member-add", cmd_member_add, "add a user to a project"),
                             ("member-remove", cmd_member_remove, "take a user out of a project (their tokens "
                                                                  "for it are refused at once)")):
        sp = projects(action, fn, help)
        sp.add_argument("project", help="the project's name")
        sp.add_argument("user", help="the user's name")

    au = add("audit", cmd_audit, "show the audit record, newest first (admins)")
    au.add_argument("--limit", type=int, default=50, help="at most this many entries (default: 50)")
    au.add_argument("--action", help="only this action (submit, cancel, token_issue, ...)")
    au.add_argument("--actor", help="only this user's actions")
    au.add_argument("--before", type=int, help="only entries older than this id (the next page)")
    add("whoami", cmd_whoami, "show who the token acts as: user, admin or not, project")


def limits(pairs: list[str]) -> dict[str, Any] | None:
    """--limit KEY=VALUE ...: each value as JSON (4, 2.5; empty: null, which removes it), else as text (the
    server names a wrong one)."""
    if not pairs:
        return None
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise LocalError(f"--limit {pair}: KEY=VALUE, KEY one of {LIMIT_KEYS}")
        try:
            out[key] = json.loads(value) if value else None
        except ValueError:
            out[key] = value
    return out


def duration(text: str) -> int:
    """--expires: a whole number of seconds, or of minutes, hours or days (45m, 12h, 30d)."""
    found = DURATION.fullmatch(text.strip().lower())
    if found is None or int(found[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 30d, 12h, 45m or 3600 (seconds)")
    return int(found[1]) * UNIT_S[found[2]]


def cmd_users(client: Client, args) -> int:
    show(client.admin.users(), args.json, users_table)
    return 0


def cmd_user_add(client: Client, args) -> int:
    show(client.admin.add_user(args.name, args.admin), args.json, lambda u: users_table([u]))
    return 0


def cmd_user_set(client: Client, args) -> int:
    show(client.admin.set_admin(args.name, args.admin), args.json, lambda u: users_table([u]))
    return 0


def cmd_user_delete(client: Client, args) -> int:
    def render(gone: dict) -> None:
        tokens = ", ".join(str(t) for t in gone["tokens"]) or "none"
        console.print(f"user {shown(gone['name'])} deleted; out of {shown(', '.join(gone['projects']) or 'no project')}"
                      f"; tokens refused from now on: {tokens}")
    show(client.admin.delete_user(args.name), args.json, render)
    return 0


def cmd_token(client: Client, args) -> int:
    def render(t: dict) -> None:
        where = f"in project {t['project']}" if t["project"] else "across all projects"
        until = f", until {t['expires_at'][:19].replace('T', ' ')} UTC" if t.get("expires_at") else ""
        console.print(f"token {t['id']} for {shown(t['user'])} {shown(where)}{until}; it is shown only now, keep it:")
        print(t["token"])
    show(client.admin.issue_token(args.name, args.project, args.label, args.expires), args.json, render)
    return 0


def cmd_revoke(client: Client, args) -> int:
    client.admin.revoke_token(args.token_id)
    show({"revoked": args.token_id}, args.json, lambda r: console.print(f"token {r['revoked']} revoked"))
    return 0


def cmd_projects(client: Client, args) -> int:
    show(client.admin.projects(), args.json, projects_table)
    return 0


def cmd_project_add(client: Client, args) -> int:
    made = client.admin.add_project(args.name, 1.0 if args.share is None else args.share, limits(args.limit))
    show(made, args.json, lambda p: projects_table([p]))
    return 0


def cmd_project_set(client: Client, args) -> int:
    show(client.admin.set_project(args.name, args.share, limits(args.limit)), args.json,
         lambda p: projects_table([p]))
    return 0


def cmd_member_add(client: Client, args) -> int:
    show(client.admin.add_member(args.project, args.user), args.json, lambda p: projects_table([p]))
    return 0


def cmd_member_remove(client: Client, args) -> int:
    show(client.admin.remove_member(args.project, args.user), args.json, lambda p: projects_table([p]))
    return 0


def cmd_audit(client: Client, args) -> int:
    show(client.admin.audit(limit=args.limit, before=args.before, action=args.action, actor=args.actor),
         args.json, audit_table)
    return 0


def cmd_whoami(client: Client, args) -> int:
    def render(me: dict) -> None:
        role = "an admin" if me["admin"] else "a user"
        where = f"in project {me['project']}" if me["project"] else "across all projects"
        console.print(f"{shown(me['user'])}: {role}, acting {shown(where)}")
    show(client.me(), args.json, render)
    return 0


def users_table(users: list) -> None:
    t = Table("id", "name", "admin", "projects", "tokens (id label @project, until UTC)")
    for u in users:
        tokens = ", ".join(f"{k['id']} {k['label'] or '-'} @{k['project'] or '*'}"
                           + (f" until {k['expires_at'][:16].replace('T', ' ')}" if k.get("expires_at") else "")
                           for k in u.get("tokens") or [])
        t.add_row(str(u["id"]), shown(u["name"]), "yes" if u["admin"] else "", shown(", ".join(u["projects"])),
                  shown(tokens or "-"))
    console.print(t)


def projects_table(projects: list) -> None:
    t = Table("id", "name", "share", "limits", "members")
    for p in projects:
        shown_limits = ", ".join(f"{k}={v}" for k, v in (p["limits"] or {}).items())
        t.add_row(str(p["id"]), shown(p["name"]), f"{p['share']:g}", shown(shown_limits or "-"),
                  shown(", ".join(p["members"]) or "-"))
    console.print(t)


def audit_table(entries: list) -> None:
    t = Table("id", "at (UTC)", "actor", "project", "action", "target", "client", "detail")
    for e in entries:
        detail = json.dumps(e["detail"], separators=(",", ":")) if e.get("detail") else ""
        t.add_row(str(e["id"]), e["at"][:19].replace("T", " "), shown(e["actor"]), shown(e["project"] or "-"),
                  shown(e["action"]), shown(e["target"] or ""), shown(e["client"] or ""), shown(detail))
    console.print(t)
