"""What a job may ask of Slurm (docs/scaling-out.md, "Slurm"): where it runs (`runs_on`), and within the service's
Slurm settings, its own partition, account, QOS and time limit (`slurm`). Nothing else of sbatch is a job's: no
free-form options, so a client's value never becomes a flag. Every name is a Slurm name (SLURM_NAME), checked
here for the API and again where the agent builds sbatch's arguments (app/clusters/slurm.py)."""
import re
from typing import Annotated, Any

from pydantic import Field

from trainyard.app.core.errors import Invalid
from trainyard.app.core.settings import Settings
from trainyard.app.spec.common import _Strict

# Slurm's partition, account and QOS names: letters, digits, '_', '.', '-', '+' (no space, no shell or list
# separator: ',' would split --partition into several), at most 64.
SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
MAX_TIME_LIMIT_MIN = 365 * 24 * 60

SlurmName = Annotated[str, Field(pattern=f"^{SLURM_NAME.pattern}$", description="a Slurm name: letters, digits, "
                                 "'_', '.', '-', '+', at most 64")]


class SlurmRequest(_Strict):
    """A job's own Slurm choices; each unset one is its project's, else the service's (TRAINYARD_SLURM_*)."""
    partition: SlurmName | None = Field(None, description="one of the partitions the service lets jobs name "
                                        "(TRAINYARD_SLURM_JOB_PARTITIONS)")
    account: SlurmName | None = Field(None, description="the account charged (where TRAINYARD_SLURM_JOB_ACCOUNTS "
                                      "is on)")
    qos: SlurmName | None = Field(None, description="the QOS (where TRAINYARD_SLURM_JOB_ACCOUNTS is on)")
    time_limit_min: int | None = Field(None, ge=1, le=MAX_TIME_LIMIT_MIN, description="the allocation's time "
                                       "limit (minutes), at most the service's: past it Slurm ends the run (timeout)")


def configured(settings: Settings) -> bool:
    return bool(settings.slurm_partition)


def resolve(spec: Any, settings: Settings) -> None:
    """Check a submitted job's Slurm fields against the service's settings, and send it to Slurm when the job does
    not say and the service's default does (TRAINYARD_SLURM_DEFAULT): the stored spec, and so the jobs row
    (app/db/tables.py), then says so. Invalid (422) naming the field when the job asks for what the service does not
    offer."""
    if spec.runs_on is None and settings.slurm_default and configured(settings):
        spec.runs_on = "slurm"
    if spec.runs_on != "slurm":
        return
    if not configured(settings):
        raise Invalid("this service runs no job on Slurm (TRAINYARD_SLURM_PARTITION is not set); "
                      "drop runs_on and slurm", loc=("runs_on",))
    asked: SlurmRequest = spec.slurm or SlurmRequest()
    others = (p.strip() for p in settings.slurm_job_partitions.split(",") if p.strip())
    allowed = {settings.slurm_partition or "", *others}
    if asked.partition is not None and asked.partition not in allowed:
        raise Invalid(f"partition {asked.partition!r} is not one a job may name here: {', '.join(sorted(allowed))}",
                      loc=("slurm", "partition"))
    for name in ("account", "qos"):
        if getattr(asked, name) is not None and not settings.slurm_job_accounts:
            raise Invalid(f"a job may not name its own {name} here (TRAINYARD_SLURM_JOB_ACCOUNTS is off)",
                          loc=("slurm", name))
    limit = settings.slurm_time_limit_min
    if asked.time_limit_min is not None and limit is not None and asked.time_limit_min > limit:
        raise Invalid(f"time_limit_min {asked.time_limit_min} is over the service's {limit}",
                      loc=("slurm", "time_limit_min"))
