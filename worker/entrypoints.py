"""`run` jobs: an installed entrypoint plugin, fn(ctx, config), called in the job process under
trainyard's guarantees (the Context in worker/public_context.py carries them)."""
import json
from typing import Any

from trainyard.app.core import plugins
from trainyard.app.spec import RunJob
from trainyard.worker.errors import JobError, Preempted
from trainyard.worker.job_context import JobContext
from trainyard.worker.public_context import Context

MAX_RESULT_BYTES = 64 << 10


def run(spec: RunJob, job: JobContext, attempt: int) -> dict[str, Any]:
    """Call the entrypoint; its return value (JSON) is the job's result. Raises Preempted when it returned
    after a stop request: it stopped, it did not finish."""
    try:
        fn = plugins.load("entrypoints", spec.entrypoint)
    except LookupError as e:
        raise JobError(str(e)) from None
    ctx = Context(job, dict(spec.config), attempt)
    if ctx.restore() is not None and job.resume_path is not None:  # restore() reads resume_path
        job.log(f"resuming: ctx.restore() returns the checkpoint at {job.resume_path.name}")
    value = fn(ctx, dict(spec.config))
    if ctx.should_stop():
        raise Preempted(f"entrypoint {spec.entrypoint!r} returned after a stop request")
    result = value if isinstance(value, dict) else {} if value is None else {"value": value}
    try:
        text = json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise JobError(f"entrypoint {spec.entrypoint!r} returned what is not JSON: {e}") from None
    if len(text) > MAX_RESULT_BYTES:
        raise JobError(f"entrypoint {spec.entrypoint!r} returned {len(text):,} bytes of JSON; a result holds at most "
                       f"{MAX_RESULT_BYTES // 1024} KiB (save larger outputs with ctx.save_model)")
    return result
