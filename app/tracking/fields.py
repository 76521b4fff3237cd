"""What an MLflow run holds of a trainyard job or sweep, from its row: parameters (the spec, flattened, within
MLflow's limits), metric points (one per epoch and metric, step = epoch), tags, and the run's status. Pure: no
MLflow import, no database, so that each mapping is tested alone (tests/observe/test_tracking_fields.py)."""
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from trainyard.app.core.states import JobState, SweepState

# MLflow's limits (mlflow.utils.validation): a key's length, a parameter's value, and what one log_batch call takes.
MAX_KEY = 250
MAX_PARAM_VALUE = 6000
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
# The characters MLflow allows in a metric's, a parameter's and a tag's name; others become "_".
_NOT_IN_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")
# Keys of a job's metric record that are bookkeeping, not results.
_NOT_METRICS = {"epoch"}

# A job's end, as MLflow's run status: a pruned trial did not fail, it was stopped (KILLED, tagged pruned).
STATUS = {
    JobState.SUCCEEDED: "FINISHED", JobState.FAILED: "FAILED", JobState.CANCELLED: "KILLED",
    JobState.PRUNED: "KILLED",
}
SWEEP_STATUS = {SweepState.SUCCEEDED: "FINISHED", SweepState.FAILED: "FAILED", SweepState.CANCELLED: "KILLED"}
ENDED = frozenset(STATUS.values())


def key(name: str) -> str:
    return _NOT_IN_KEY.sub("_", name)[:MAX_KEY] or "_"


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """A spec as MLflow parameters: nested objects' keys joined with "." (train.lr), lists and scalars as their
    JSON (a value past MLflow's limit cut, ending in "..."), None left out."""
    out: dict[str, str] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if value is None or not prefix:
        return out
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)
    if len(text) > MAX_PARAM_VALUE:
        text = text[:MAX_PARAM_VALUE - 3] + "..."
    out[key(prefix)] = text
    return out


def number(value: Any) -> float | None:
    """A metric's value, or None for what MLflow should not get (a bool, None, text, NaN or an infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def points(epochs: list[tuple[int, Mapping[str, Any], float]]) -> Iterator[tuple[str, float, int, int]]:
    """(key, value, timestamp in ms, step) for every number of every epoch's record (epoch, data, recorded at).
    The timestamp is the record's own, so that sending an epoch twice sends the same point (MLflow keeps one)."""
    for epoch, data, at in epochs:
        for name, raw in data.items():
            value = number(raw)
            if value is not None and name not in _NOT_METRICS:
                yield key(name), value, int(at * 1000), epoch


def finals(result: Mapping[str, Any] | None) -> dict[str, float]:
    """A result's numbers (a train job's kept epoch's val_loss and accuracy, an evaluation's accuracy, what a run
    job returned): "final/<name>" metrics, as in the job's TensorBoard files."""
    out = {}
    for name, raw in (result or {}).items():
        value = number(raw)
        if value is not None:
            out[key(f"final/{name}")] = value
    return out


def job_tags(job: Mapping[str, Any], url: str, project: str | None) -> dict[str, str]:
    """A job's run's tags: where it is in trainyard and who ran it where. `job`: its row's values."""
    spec = job.get("spec") or {}
    tags = {
        "mlflow.runName": job.get("name") or f"job-{job['id']}",
        "trainyard.job_id": str(job["id"]),
        "trainyard.kind": "evaluate" if job["kind"] == "predict" else job["kind"],
        "trainyard.url": f"{url.rstrip('/')}/#/jobs/{job['id']}",
        "trainyard.project": project or "default",
        "trainyard.attempt": str(job.get("attempt") or 0),
        "trainyard.claim": str(job.get("claim") or 0),
    }
    if job.get("owner"):
        tags["mlflow.user"] = str(job["owner"])
    if job.get("worker_id"):
        tags["trainyard.worker"] = str(job["worker_id"])
    if job.get("device"):
        tags["trainyard.device"] = str(job["device"])
    commit = (spec.get("tracking") or {}).get("git_commit")
    if commit:
        tags["mlflow.source.git.commit"] = commit
    if job.get("sweep"):
        tags["trainyard.sweep_id"] = str(job["sweep"].get("id"))
        tags["trainyard.trial"] = str(job["sweep"].get("trial"))
    if job["state"] == JobState.PRUNED:
        tags["trainyard.pruned"] = "true"
    error = job.get("error")
    if job["state"] in (JobState.FAILED, JobState.CANCELLED, JobState.PRUNED) and error:
        tags["trainyard.error_class"] = str(error.get("class"))
        tags["trainyard.error"] = str(error.get("message", ""))[:MAX_PARAM_VALUE]
    return tags


def sweep_tags(sweep: Mapping[str, Any], url: str, project: str | None, goal: str) -> dict[str, str]:
    spec = sweep.get("spec") or {}
    tags = {
        "mlflow.runName": sweep.get("name") or f"sweep-{sweep['id']}",
        "trainyard.sweep_id": str(sweep["id"]),
        "trainyard.url": f"{url.rstrip('/')}/#/sweeps/{sweep['id']}",
        "trainyard.project": project or "default",
        "trainyard.objective": f"{goal} {spec.get('metric', '')}".strip(),
    }
    if sweep.get("owner"):
        tags["mlflow.user"] = str(sweep["owner"])
    return tags


def experiment_name(template: str, spec: Mapping[str, Any], project: str | None) -> str:
    """The job's own (tracking.experiment), else the service's template with {project} filled in."""
    own = (spec.get("tracking") or {}).get("experiment")
    return own or template.replace("{project}", project or "default")


def public_uri(tracking_uri: str) -> str:
    """The tracking URI without the credentials it may carry (http://user:password@host): what a job's record and
    an error may show to whoever sees the job."""
    parts = urlsplit(tracking_uri)
    if "@" not in parts.netloc:
        return tracking_uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def redact(text: str, secrets: Iterable[str]) -> str:
    """text with every secret (a password, a token, a URI's credentials) replaced by ***."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def run_url(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run's page in MLflow's UI, where the tracking URI is the UI's own server (its credentials left out)."""
    if not run_id or not experiment_id or not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{public_uri(tracking_uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
