"""What a principal may see of jobs: its project's (an admin: every project's, and the rows from before accounts,
whose project is NULL). Any other job answers exactly as a missing one does (NotFound with the same message), so
that another project's ids are never disclosed; lists and counts keep `job_scope`'s rows. (Sweeps: sweep_reads,
given who asks.) Torch-free.
"""
from typing import Literal

from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ColumnElement

from trainyard.app.accounts import Principal, project_rows
from trainyard.app.core.errors import NotFound
from trainyard.app.db import jobs
from trainyard.app.records import Job, job_reads


def job_for(engine: Engine, who: Principal | None, job_id: int) -> Job:
    """The job, if `who` may see it (None: the service itself, which sees all); else NotFound, as for an id that
    was never given."""
    return seen(who, job_reads.get_job(engine, job_id))


def seen(who: Principal | None, job: Job) -> Job:
    if who is not None and not who.sees(job.project_id):
        raise NotFound(f"job {job.id} not found")
    return job


def job_scope(who: Principal) -> ColumnElement[bool] | None:
    """The condition on the jobs table a list (and its count) keeps for `who`; None: every row (an admin)."""
    return project_rows(jobs, who)


def job_project(who: Principal | None) -> int | Literal[False] | None:
    """job_scope as a value, for statements built once (job_reads.list_page): the project whose jobs `who` sees;
    None: every job (an admin, or None: the service itself); False: none (a user in no project)."""
    if who is None or who.admin:
        return None
    return False if who.project_id is None else who.project_id
