"""Signing in to the dashboard: POST /session sets a session of the token's (never the token) in an HttpOnly cookie,
DELETE /session ends it and clears the cookie, both refused from other web origins; in a real headless Chromium
against a live server with TRAINYARD_API_TOKEN, a team (tests/teams.py) and a CPU worker, a user signed in sees
their project's jobs and none of another's, and the page's script never holds the token."""
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.helpers.jobs import tiny_job
from tests.helpers.service import Service, live_service, serving
from tests.helpers.teams import Team, make_team, service_engine
from trainyard.app import accounts

if TYPE_CHECKING:
    from playwright.sync_api import Browser

ADMIN_TOKEN = "signin-s3cret"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MONTH_S = 30 * 24 * 3600

pytestmark = pytest.mark.slow


live = live_service(env={"TRAINYARD_API_TOKEN": ADMIN_TOKEN})


@pytest.fixture(scope="module")
def team(live) -> Team:
    return make_team(live)


@pytest.fixture(scope="module")
def jobs(live, team) -> dict[str, int]:
    """Each user's job, ended: ann's in project alpha, ben's in beta."""
    ids = {}
    for user in ("ann", "ben"):
        with team.client(user) as c:
            r = c.post("/jobs", json={**tiny_job(), "name": f"{user}-job"})
            assert r.status_code == 201, r.text
            ids[user] = r.json()["id"]
    for job_id in ids.values():
        assert live.wait_state(job_id)["state"] == "succeeded"
    return ids


def cookie_attrs(response: httpx.Response) -> dict[str, str]:
    """The Set-Cookie of the session cookie, as {attribute (lowercase): value}, its value under "value"."""
    [header] = [h for h in response.headers.get_list("set-cookie") if h.startswith("trainyard_token=")]
    first, *rest = [part.strip() for part in header.split(";")]
    attrs = {"value": first.split("=", 1)[1]}
    for part in rest:
        name, _, value = part.partition("=")
        attrs[name.lower()] = value
    return attrs


# ---- /session over HTTP -----------------------------------------------------------------------------------------

def test_signing_in_sets_an_httponly_strict_cookie_that_authenticates_later_requests(live, team):
    r = httpx.post(f"{live.url}/session", json={"token": team.tokens["ben"]})
    assert r.status_code == 204, r.text
    attrs = cookie_attrs(r)
    assert attrs["value"].startswith("tys_") and team.tokens["ben"] not in r.headers["set-cookie"]
    assert {"httponly", "path", "samesite", "max-age"} <= attrs.keys() and "secure" not in attrs  # plain http
    assert attrs["path"] == "/" and attrs["samesite"].lower() == "strict" and attrs["max-age"] == str(MONTH_S)
    assert r.headers["cache-control"] == "no-store"

    with httpx.Client(base_url=live.url) as c:
        assert c.get("/jobs").status_code == 401  # no header, no cookie
        c.cookies.set("trainyard_token", attrs["value"])
        assert c.get("/jobs").status_code == 200
        # The header wins over the cookie: a wrong one is refused whatever the cookie holds.
        assert c.get("/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401

    # A form's post (its own operation, and to /session as before), and the admin's token (TRAINYARD_API_TOKEN),
    # work as well.
    for path in ("/session/form", "/session"):
        r = httpx.post(f"{live.url}{path}", data={"token": ADMIN_TOKEN})
        assert r.status_code == 204 and cookie_attrs(r)["value"].startswith("tys_") and ADMIN_TOKEN not in r.text


def test_over_https_the_cookie_is_secure(live, team):
    # The server believes a proxy on loopback that says the request came over https (uvicorn's forwarded headers).
    r = httpx.post(f"{live.url}/session", json={"token": team.tokens["ann"]}, headers={"X-Forwarded-Proto": "https"})
    assert r.status_code == 204 and "secure" in cookie_attrs(r)
    r = httpx.delete(f"{live.url}/session", headers={"X-Forwarded-Proto": "https"})
    assert r.status_code == 204 and "secure" in cookie_attrs(r)


def test_a_wrong_revoked_or_missing_token_is_refused_and_sets_no_cookie(live, team):
    engine = service_engine(live)
    try:
        revoked = accounts.issue_token(engine, "ben", "beta", label="to revoke")
        assert httpx.post(f"{live.url}/session", json={"token": revoked["token"]}).status_code == 204
        accounts.revoke_token(engine, revoked["id"])
    finally:
        engine.dispose()
    for token in ("wrong", ADMIN_TOKEN + "x", "tyk_" + "A" * 43, revoked["token"], " "):
        r = httpx.post(f"{live.url}/session", json={"token": token})
        assert r.status_code in (401, 422) and "set-cookie" not in r.headers, (token, r.text)
        assert r.status_code == 422 or "not one of this server's" in r.json()["detail"]
    with httpx.Client(base_url=live.url, cookies={"trainyard_token": revoked["token"]}) as c:
        assert c.get("/jobs").status_code == 401  # a cookie of a revoked token: refused at once
    for body in ({"json": {}}, {"json": {"token": "x" * 5000}}, {"content": b"{", "headers": {
            "content-type": "application/json"}}, {"data": {"other": "x"}}, {"data": {"token": ""}}):
        for path in ("/session", "/session/form"):
            r = httpx.post(f"{live.url}{path}", **body)
            assert r.status_code == 422 and "set-cookie" not in r.headers, r.text
            assert "token" in r.json()["detail"]
    r = httpx.post(f"{live.url}/session/form", data={"token": "wrong"})
    assert r.status_code == 401 and "set-cookie" not in r.headers


def test_signing_in_or_out_from_another_web_origin_is_refused(live, team):
    token = team.tokens["ben"]
    host = live.url.split("//", 1)[1]
    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site"}):
        for method, path, kw in (("POST", "/session", {"json": {"token": token}}),
                                 ("POST", "/session", {"data": {"token": token}}),
                                 ("POST", "/session/form", {"data": {"token": token}}), ("DELETE", "/session", {})):
            r = httpx.request(method, f"{live.url}{path}", headers=headers, **kw)
            assert r.status_code == 403 and "set-cookie" not in r.headers, (method, path, headers, r.text)
    # The page's own origin may.
    for headers in ({"Origin": f"http://{host}"}, {"Sec-Fetch-Site": "same-origin"}):
        r = httpx.post(f"{live.url}/session", json={"token": token}, headers=headers)
        assert r.status_code == 204, r.text


def test_signing_out_clears_the_cookie(live, team):
    with httpx.Client(base_url=live.url) as c:
        assert c.post("/session", json={"token": team.tokens["ben"]}).status_code == 204
        assert c.get("/jobs").status_code == 200
        r = c.delete("/session")
        assert r.status_code == 204
        attrs = cookie_attrs(r)
        assert attrs["value"] in ("", '""') and attrs["max-age"] == "0" and attrs["path"] == "/"
        assert "trainyard_token" not in c.cookies
        assert c.get("/jobs").status_code == 401


def test_an_open_server_takes_only_tokens_it_knows(tmp_path):
    """Without TRAINYARD_API_TOKEN a request without a token acts as the admin, but signing in still names someone:
    a made-up token is refused, a user's token signs in as them."""
    with serving(tmp_path / "data", workers=0) as svc:
        team = make_team(svc)
        assert httpx.post(f"{svc.url}/session", json={"token": "anything"}).status_code == 401
        r = httpx.post(f"{svc.url}/session", json={"token": team.tokens["ann"]})
        assert r.status_code == 204 and cookie_attrs(r)["value"].startswith("tys_")


def test_the_session_routes_are_documented(live):
    doc = httpx.get(f"{live.url}/openapi.json").json()
    ops, form = doc["paths"]["/session"], doc["paths"]["/session/form"]["post"]
    assert ops["post"]["operationId"] == "sign_in" and ops["delete"]["operationId"] == "sign_out"
    assert form["operationId"] == "sign_in_form"
    # One media type an operation (a client generator makes one body argument of each): JSON, and a form's.
    session_in = {"schema": {"$ref": "#/components/schemas/SessionIn"}}
    assert ops["post"]["requestBody"]["content"] == {"application/json": session_in}
    assert form["requestBody"]["content"] == {"application/x-www-form-urlencoded": session_in}
    assert doc["components"]["schemas"]["SessionIn"]["required"] == ["token"]
    for op in (ops["post"], form):
        assert {"204", "401", "403", "422"} <= op["responses"].keys()
        assert "security" not in op  # no token needed to present one


# ---- the page, in Chromium ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def context(browser: "Browser"):
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    ctx.set_default_timeout(15_000)
    yield ctx
    ctx.close()


def session_cookies(context) -> list[dict]:
    return [c for c in context.cookies() if c["name"] == "trainyard_token"]


def test_ben_signs_in_sees_only_betas_jobs_never_holds_the_token_and_signs_out(live, team, jobs, context):
    from playwright.sync_api import expect

    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    sent: list[dict[str, str]] = []
    page.on("request", lambda r: sent.append(r.all_headers()))
    page.goto(live.url + "/")
    token = page.get_by_label("Token")
    expect(token).to_be_visible()
    expect(token).to_have_attribute("type", "password")
    expect(page.get_by_test_id("sign-out")).to_be_hidden()

    token.fill(team.tokens["ben"])
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_test_id(f"job-row-{jobs['ben']}")).to_be_visible()
    expect(page.get_by_test_id(f"job-state-{jobs['ben']}")).to_have_text("succeeded")
    # One answer of GET /jobs holds the whole list: ben's row is there, so ann's would be too.
    expect(page.get_by_test_id(f"job-row-{jobs['ann']}")).to_have_count(0)
    expect(page.get_by_test_id("jobs-table")).not_to_contain_text("ann-job")
    expect(token).to_be_hidden()
    expect(page.get_by_test_id("who")).to_have_text("ben · project beta")

    # The token is in the browser's cookie jar, out of the script's reach: not in document.cookie, not in storage,
    # never sent in a header by the script.
    [cookie] = session_cookies(context)
    assert cookie["value"].startswith("tys_") and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert team.tokens["ben"] not in page.evaluate("document.cookie")
    stored = page.evaluate("JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage)])")
    assert team.tokens["ben"] not in stored
    assert not any("authorization" in h for h in sent)
    assert any(cookie["value"] in h.get("cookie", "") for h in sent)
    assert not any(team.tokens["ben"] in h.get("cookie", "") for h in sent)  # a session, never the token

    page.goto(f"{live.url}/#/jobs/{jobs['ann']}")  # ann's job, by its address: as if it did not exist
    expect(page.get_by_test_id("job-missing")).to_be_visible()
    expect(page.get_by_test_id("job-missing")).to_contain_text(f"Job {jobs['ann']} does not exist")
    page.goto(f"{live.url}/#/jobs/{jobs['ben']}")
    expect(page.get_by_test_id("job-title")).to_contain_text("ben-job")

    page.get_by_test_id("sign-out").click()
    expect(token).to_be_visible()
    assert session_cookies(context) == []
    expect(page.get_by_test_id(f"job-row-{jobs['ben']}")).to_have_count(0)
    page.reload()
    expect(token).to_be_visible()
    assert errors == []


def test_a_wrong_token_shows_an_error_and_sets_no_cookie(live, team, context):
    from playwright.sync_api import expect

    page = context.new_page()
    page.goto(live.url + "/")
    token = page.get_by_label("Token")
    token.fill("tyk_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_test_id("token-error")).to_contain_text("refused")
    expect(token).to_be_visible()
    expect(token).to_have_value("")  # the field does not keep it either
    assert session_cookies(context) == []

    token.fill(ADMIN_TOKEN)  # then the admin's: every project's jobs
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_test_id("jobs-table")).to_be_visible()
    expect(page.get_by_test_id("token-error")).to_be_hidden()
    expect(page.get_by_test_id("who")).to_have_text("admin (admin) · all projects")
    [cookie] = session_cookies(context)
    assert cookie["value"].startswith("tys_") and ADMIN_TOKEN not in cookie["value"]


def test_a_revoked_token_signs_the_page_out(live, context):
    """Revoking a signed-in user's token brings the form back at the page's next poll, saying why."""
    from playwright.sync_api import expect

    engine = service_engine(live)
    try:
        issued = accounts.issue_token(engine, "ann", "alpha", label="browser")
        page = context.new_page()
        page.goto(live.url + "/")
        page.get_by_label("Token").fill(issued["token"])
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_test_id("jobs-table")).to_be_visible()
        expect(page.get_by_test_id("status")).to_have_text("live")
        accounts.revoke_token(engine, issued["id"])
    finally:
        engine.dispose()
    expect(page.get_by_label("Token")).to_be_visible()
    expect(page.get_by_test_id("token-error")).to_contain_text("sign in again")


def test_a_service_stays_usable_for_an_earlier_pages_local_storage(browser, tmp_path):
    """A token an earlier dashboard kept in local storage is removed, and the page never sends it."""
    from playwright.sync_api import expect

    svc = Service(tmp_path / "data", env={"TRAINYARD_API_TOKEN": ADMIN_TOKEN}).start_server()
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(svc.url + "/healthz")
        page.evaluate(f"localStorage.setItem('trainyard.token', '{ADMIN_TOKEN}')")
        page.goto(svc.url + "/")
        expect(page.get_by_label("Token")).to_be_visible()  # not signed in by it
        assert page.evaluate("localStorage.getItem('trainyard.token')") is None
    finally:
        ctx.close()
        svc.stop()
