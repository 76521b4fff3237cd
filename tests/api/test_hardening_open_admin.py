"""A server without TRAINYARD_API_TOKEN is the admin's only for a client at the machine (issue 37, critical).

The open admin is decided by the connection's own peer address, never by a header the client writes: a client
at 203.0.113.9 sending `Host: localhost` was the admin, made an admin user and minted its token. The app is
driven in-process with the peer address chosen (httpx's ASGI transport sets the scope's client, as uvicorn does
from the socket), and through a real `trainyard serve` for what only a live server shows: uvicorn's
X-Forwarded-For handling, and a server on every interface making and keeping its own admin token.
"""
import asyncio
import stat

import httpx
import pytest

from tests.helpers.service import Service
from tests.helpers.teams import make_team
from trainyard.app.api import create_app
from trainyard.app.core import operator_token
from trainyard.app.core.settings import Settings

OUTSIDER = ("203.0.113.9", 40000)


async def _calls(settings: Settings, peer: tuple[str, int], calls: list[tuple[str, str, dict]]) -> list[httpx.Response]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=peer)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost:8000") as c:
            return [await c.request(method, path, **kw) for method, path, kw in calls]


def calls(settings: Settings, peer: tuple[str, int], *requests: tuple[str, str, dict]) -> list[httpx.Response]:
    return asyncio.run(_calls(settings, peer, list(requests)))


@pytest.fixture
def open_settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url="", api_token=None)


def test_an_outsider_writing_host_localhost_is_refused_whatever_it_sends(open_settings):
    """The probe of the issue: GET /me, POST /admin/users and a token for the new user, from 203.0.113.9 with
    `Host: localhost:8000`, with no Authorization, with `Bearer junk`, and with forwarding headers naming
    loopback: every one 401, and no user was made."""
    host = {"Host": "localhost:8000"}
    tries = [{}, {"Authorization": "Bearer junk"}, {"X-Forwarded-For": "127.0.0.1"}, {"Forwarded": "for=127.0.0.1"},
             {"X-Real-IP": "127.0.0.1"}]
    requests = []
    for extra in tries:
        headers = {**host, **extra}
        requests += [("GET", "/me", {"headers": headers}),
                     ("POST", "/admin/users", {"headers": headers, "json": {"name": "mallory", "admin": True}}),
                     ("POST", "/admin/users/mallory/tokens", {"headers": headers, "json": {}})]
    answers = calls(open_settings, OUTSIDER, *requests, ("GET", "/admin/users", {}))
    *attack, listing = answers
    assert [r.status_code for r in attack] == [401] * len(attack), [(r.status_code, r.text) for r in attack]
    assert listing.status_code == 401
    # The same app, asked from the machine itself: the admin, and no mallory was ever made.
    me, users = calls(open_settings, ("127.0.0.1", 40001), ("GET", "/me", {}), ("GET", "/admin/users", {}))
    assert me.json() == {"user": "admin", "admin": True, "project": None}
    assert "mallory" not in [u["name"] for u in users.json()]


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1"])
def test_a_client_at_the_machine_is_the_admin_of_an_open_server(open_settings, peer):
    (me,) = calls(open_settings, (peer, 40002), ("GET", "/me", {}))
    assert me.status_code == 200 and me.json()["admin"] is True


def test_at_the_machine_a_wrong_token_or_a_proxy_hop_is_no_admin(open_settings):
    """A token sent is checked even on an open server (a typo never falls back to admin), and a request relayed
    by a proxy on this machine is the proxy's client's, not the machine's."""
    here = ("127.0.0.1", 40003)
    junk, relayed = calls(open_settings, here, ("GET", "/me", {"headers": {"Authorization": "Bearer junk"}}),
                          ("GET", "/me", {"headers": {"X-Forwarded-For": "203.0.113.9"}}))
    assert (junk.status_code, relayed.status_code) == (401, 401)


def test_a_users_token_acts_as_its_user_from_anywhere(tmp_path):
    """Tokens restrict again: an outsider's valid member token acts as that member, not as the admin."""
    svc = Service(tmp_path / "data").start_server()
    try:
        team = make_team(svc)
    finally:
        svc.stop()
    settings = Settings(data_dir=tmp_path / "data", database_url="", api_token=None)
    ann = {"headers": {"Authorization": f"Bearer {team.tokens['ann']}"}}
    me, admin = calls(settings, OUTSIDER, ("GET", "/me", ann), ("GET", "/admin/users", ann))
    assert me.json() == {"user": "ann", "admin": False, "project": "alpha"}
    assert admin.status_code == 403


def test_a_live_open_server_takes_x_forwarded_for_as_the_client(tmp_path):
    """Through uvicorn: a loopback peer relaying for 203.0.113.9 (X-Forwarded-For, which uvicorn trusts from
    127.0.0.1 and puts in the peer's place) is refused; the same request without it is the admin."""
    svc = Service(tmp_path / "data").start_server()
    try:
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            assert c.get("/me").json()["admin"] is True
            relayed = c.get("/me", headers={"X-Forwarded-For": "203.0.113.9"})
            assert relayed.status_code == 401, relayed.text
            assert c.get("/me", headers={"Authorization": "Bearer junk"}).status_code == 401
    finally:
        svc.stop()


def test_serve_beyond_loopback_makes_its_admin_token_and_keeps_it(tmp_path):
    """`trainyard serve --host 0.0.0.0` with no token: the server makes one in its data dir (mode 0600), says
    where (not what) on its output, and wants it from every client, loopback included; a restart keeps it."""
    data = tmp_path / "data"
    svc = Service(data)
    svc.host = "0.0.0.0"
    svc.start_server()
    try:
        token = operator_token.read(data)
        assert token and len(token) >= 40
        assert stat.S_IMODE(operator_token.path(data).stat().st_mode) == 0o600
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            assert c.get("/me").status_code == 401
            assert c.get("/me", headers={"Host": "localhost"}).status_code == 401
            assert c.get("/me", headers={"Authorization": f"Bearer {token}"}).json()["admin"] is True
        out = svc.output()
        assert str(operator_token.path(data).resolve()) in out and token not in out
    finally:
        svc.stop()
    # A restart, on loopback this time: the data dir's token still stands (Settings read it).
    again = Service(data).start_server()
    try:
        with httpx.Client(base_url=again.url, timeout=10) as c:
            assert c.get("/me").status_code == 401
            assert c.get("/me", headers={"Authorization": f"Bearer {token}"}).json()["admin"] is True
        assert operator_token.read(data) == token
    finally:
        again.stop()


def test_loopback_names():
    assert all(operator_token.loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost",
                                                     "api.localhost", "::ffff:127.0.0.1"))
    assert not any(operator_token.loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "gpu-box", "203.0.113.9", ""))
