"""A real S3 protocol server for the tests: moto's server mode in a process of its own on 127.0.0.1,
and a fresh bucket per test. Clients reach it through the usual AWS_* variables, as they would MinIO."""
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tests.helpers.service import free_port
from trainyard.app.client.http import tls


@dataclass
class Bucket:
    name: str
    env: dict[str, str]  # what a process needs to reach it: credentials, region, endpoint

    @property
    def url(self) -> str:
        return f"s3://{self.name}/trainyard"

    def client(self):
        import boto3
        return boto3.session.Session().client(
            "s3", endpoint_url=self.env["AWS_ENDPOINT_URL_S3"], region_name=self.env["AWS_DEFAULT_REGION"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def keys(self) -> list[str]:
        return sorted(o["Key"] for o in self.client().list_objects_v2(Bucket=self.name).get("Contents", ()))


@contextmanager
def s3_server() -> Iterator[str]:
    """Start moto's S3 server; yield its endpoint URL; stop it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto's S3 server exited with code {proc.returncode}")
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=1, verify=tls())
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not answer within 60 s") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def new_bucket(endpoint: str) -> Bucket:
    env = {"AWS_ACCESS_KEY_ID": "trainyard-test", "AWS_SECRET_ACCESS_KEY": "trainyard-test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint}
    bucket = Bucket(f"trainyard-{secrets.token_hex(4)}", env)
    bucket.client().create_bucket(Bucket=bucket.name)
    return bucket

