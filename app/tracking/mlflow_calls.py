"""The calls to an MLflow tracking server, through MLflow's own client (mlflow-skinny, the `mlflow` extra): runs and
experiments made, batches within MLflow's limits, a model's files as a run's artifacts and a registered version.
No bookkeeping here: app/tracking/mlflow_runs.py decides what to send and records what was sent."""
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainyard.app.core.settings import Settings
from trainyard.app.core.storage import Store
from trainyard.app.tracking import fields


def client_environment(settings: Settings) -> dict[str, str]:
    """MLflow's client reads its credentials and HTTP behaviour from the environment: the settings' values, and no
    retries of its own (a failed send is sent again by a later pass, without holding the others up)."""
    env = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(settings.mlflow_timeout_s))),
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    if settings.mlflow_username:
        env["MLFLOW_TRACKING_USERNAME"] = settings.mlflow_username
    if settings.mlflow_password:
        env["MLFLOW_TRACKING_PASSWORD"] = settings.mlflow_password.get_secret_value()
    if settings.mlflow_token:
        env["MLFLOW_TRACKING_TOKEN"] = settings.mlflow_token.get_secret_value()
    return env


def credentials(settings: Settings) -> list[str]:
    """What no error text the service keeps or shows may hold: the password, the token, the URI's credentials."""
    userinfo = urlsplit(settings.mlflow_tracking_uri).netloc.rpartition("@")[0]
    return [v.get_secret_value() for v in (settings.mlflow_password, settings.mlflow_token) if v] + \
        ([userinfo] if userinfo else [])


class Mlflow:
    """One tracking server (settings.mlflow_tracking_uri), with the experiments' ids it has looked up."""

    def __init__(self, settings: Settings):
        os.environ.update(client_environment(settings))
        from mlflow.tracking import MlflowClient  # imported only by a server that tracks
        self.client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        self.experiments: dict[str, str] = {}

    def experiment(self, name: str) -> str:
        """The experiment's id, made if missing (by another sender meanwhile: its id)."""
        if name not in self.experiments:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                try:
                    self.experiments[name] = self.client.create_experiment(name)
                except Exception as exc:
                    if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                        raise
                    found = self.client.get_experiment_by_name(name)
            if found is not None:
                self.experiments[name] = found.experiment_id
        return self.experiments[name]

    def new_run(self, experiment: str, started_at: float, tags: dict[str, str]) -> tuple[str, str]:
        """(experiment id, run id) of a new run with these tags, started at started_at (epoch seconds)."""
        experiment_id = self.experiment(experiment)
        run = self.client.create_run(experiment_id, start_time=int(started_at * 1000), tags=tags,
                                     run_name=tags.get("mlflow.runName"))
        return experiment_id, run.info.run_id

    def log(self, run_id: str, params: dict[str, str] | None = None,
            points: Iterable[tuple[str, float, int, int]] = (), tags: dict[str, str] | None = None) -> None:
        """log_batch within MLflow's limits per call. Sending the same points again adds nothing: MLflow keeps one
        of each (key, value, timestamp, step)."""
        from mlflow.entities import Metric, Param, RunTag
        for chunk in _chunks([Param(k, v) for k, v in (params or {}).items()], fields.MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk)
        for chunk in _chunks([RunTag(k, v) for k, v in (tags or {}).items()], fields.MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, tags=chunk)
        for chunk in _chunks([Metric(k, v, ts, step) for k, v, ts, step in points], fields.MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=chunk)

    def end(self, run_id: str, status: str, ended_at_ms: int) -> None:
        self.client.set_terminated(run_id, status=status, end_time=ended_at_ms)

    def delete(self, run_id: str) -> None:
        self.client.delete_run(run_id)

    def log_model(self, run_id: str, store: Store, prefix: str) -> None:
        """The files under prefix in the store (a model's weights and meta.json) as the run's "model" artifacts."""
        keys = [k for k in store.keys(prefix.rstrip("/") + "/") if not k.endswith("/")]
        with tempfile.TemporaryDirectory(prefix="trainyard-mlflow-") as tmp:
            for key in keys:
                # Under its own name: a bucket object's cached copy may be named otherwise on this host.
                named = Path(tmp) / Path(key).name
                named.write_bytes(store.fetch(key).read_bytes())
                self.client.log_artifact(run_id, str(named), artifact_path="model")

    def register(self, name: str, run_id: str, job_id: int) -> str:
        """A version of registered model `name` from the run's "model" artifacts: the one made by an earlier try of
        this run, else a new one. Its version number."""
        try:
            self.client.create_registered_model(name)
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
        # The name is held to [A-Za-z0-9_.-] by the spec (tracking.register_model): safe inside the filter's quotes.
        found = self.client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
        if found:
            return str(found[0].version)
        source = f"{self.client.get_run(run_id).info.artifact_uri}/model"
        made = self.client.create_model_version(name, source=source, run_id=run_id,
                                                tags={"trainyard.job_id": str(job_id)})
        return str(made.version)


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
