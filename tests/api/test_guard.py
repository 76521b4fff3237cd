"""app/api/guard.py's judgments, from header values (the live-server tests are in test_limits_api.py)."""
import pytest
from starlette.datastructures import Headers

from trainyard.app.api.guard import cross_site, host_allowed, host_name

LOCAL = ["localhost", "127.0.0.1", "[::1]"]


@pytest.mark.parametrize("host,name", [("localhost:8000", "localhost"), ("127.0.0.1", "127.0.0.1"),
                                       ("[::1]:8000", "[::1]"), ("[::1]", "[::1]"), ("Example.COM:80", "example.com")])
def test_host_name(host, name):
    assert host_name(host) == name


def test_hosts():
    assert all(host_allowed(h, LOCAL) for h in ("localhost:8000", "127.0.0.1:1", "[::1]:8000"))
    assert not any(host_allowed(h, LOCAL) for h in ("evil.example:8000", "localhost.evil.example", "", "127.0.0.2"))
    assert host_allowed("gpu.lab.example", ["*.lab.example"])
    assert not host_allowed("lab.example.evil", ["*.lab.example"])
    assert host_allowed("anything:1", ["*"])


def headers(**h) -> Headers:
    return Headers({k.replace("_", "-"): v for k, v in h.items()})


def test_cross_site():
    own = {"host": "127.0.0.1:8000"}
    assert cross_site(headers(**own), []) is None  # curl, httpx, the CLI
    assert cross_site(headers(**own, origin="http://127.0.0.1:8000", sec_fetch_site="same-origin"), []) is None
    assert cross_site(headers(**own, sec_fetch_site="none"), []) is None
    assert cross_site(headers(**own, origin="http://127.0.0.1:3000"), [])  # same site, another port
    assert cross_site(headers(**own, origin="null"), [])
    assert cross_site(headers(**own, sec_fetch_site="cross-site"), [])
    assert cross_site(headers(**own, sec_fetch_site="same-site"), [])
    assert cross_site(headers(**own, origin="https://ops.example"), ["https://ops.example"]) is None
