"""Configuration: one Settings object read from TRAINYARD_* environment variables."""
from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")

    data_dir: Path = Path("./trainyard-data")
    # Empty means "the SQLite file under data_dir"; a PostgreSQL URL lets several hosts share one queue.
    database_url: str = ""
    url: str = "http://127.0.0.1:8000"
    api_token: str | None = None

    host: str = "127.0.0.1"
    port: int = 8000

    # A claimed job's lease; the worker renews it every heartbeat_s. Expired leases are requeued.
    lease_s: float = Field(15.0, gt=0)
    heartbeat_s: float = Field(2.0, gt=0)
    # How often an idle worker looks for work: this bounds submit-to-running latency.
    poll_s: float = Field(0.02, gt=0)
    # How long a SIGTERMed worker waits for its job to checkpoint before killing it.
    grace_s: float = Field(30.0, ge=0)
    max_body_bytes: int = Field(1 << 20, gt=0)

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir.resolve() / 'trainyard.db'}"

    def ensure_dirs(self) -> None:
        for sub in ("artifacts", "checkpoints", "datasets"):
            (self.data_dir / sub).mkdir(parents=True, exist_ok=True)


@lru_cache
def get_settings() -> Settings:
    return Settings()
