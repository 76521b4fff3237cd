"""A team for the tests of users and projects: two projects with a user each, and an admin, made with
app/accounts/__init__.py on a live Service's own database; each member's bearer token and an httpx client acting as
them."""
from dataclasses import dataclass

import httpx
from sqlalchemy.engine import Engine

from trainyard.app import accounts
from trainyard.app.client.http import tls
from trainyard.app.core.settings import Settings
from trainyard.app.db import make_engine


def service_engine(svc) -> Engine:
    """An engine on the database a tests.service.Service runs on."""
    return make_engine(Settings(data_dir=svc.env["TRAINYARD_DATA_DIR"],
                                database_url=svc.env.get("TRAINYARD_DATABASE_URL", "")).db_url)


@dataclass
class Team:
    tokens: dict[str, str]   # user name -> bearer token: "ann" (project alpha), "ben" (beta), "ada" (admin)
    url: str

    def client(self, user: str, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.tokens[user]}"},
                            timeout=30, verify=tls(), **kw)


def make_team(svc) -> Team:
    engine = service_engine(svc)
    try:
        for project in ("alpha", "beta"):
            accounts.add_project(engine, project)
        tokens = {}
        for user, project in (("ann", "alpha"), ("ben", "beta")):
            accounts.add_user(engine, user)
            accounts.add_member(engine, user, project)
            tokens[user] = accounts.issue_token(engine, user, project)["token"]
        accounts.add_user(engine, "ada", admin=True)
        tokens["ada"] = accounts.issue_token(engine, "ada", None)["token"]
    finally:
        engine.dispose()
    return Team(tokens, svc.url)
