"""Results where people already look: every tracked job and sweep as an MLflow run (docs/observing.md, "MLflow").

The server sends them, from the job's own records, in a background duty (app/duties/loops.py starts it in its
host's housekeeper process): the worker and the job never talk to the tracker, so a slow or absent tracker never
slows or fails a job, and what reaches it is only what the fenced writes of the job's claim recorded (a stale
claim's epochs never reach the tracker, as they never reach the jobs table).

- `fields`: what a run holds, from a job's row (parameters, metric points, tags, status): pure, no MLflow.
- `mlflow_runs`: the sender, a pass over the pending tracked_runs rows and what each has had sent (app/jobs/tracked.py
  makes a row with each tracked job or sweep);
- `mlflow_calls`: the calls to the tracker, through MLflow's own client (mlflow-skinny, the `mlflow` extra);
- `reads`: what a job's record says of its run.

Which rows exist, and when they wake, is app/jobs/tracked.py's. This room imports sweeps, jobs and below.
"""
