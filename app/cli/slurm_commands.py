"""`trainyard slurm-agent`: run the jobs that go to Slurm, each in an allocation of its own (app/clusters/agent.py),
from any host where Slurm's commands work (sbatch, squeue, scancel) and the database is reached."""
from trainyard.app.core.settings import get_settings


def add_commands(sub) -> None:
    a = sub.add_parser("slurm-agent", help="run the jobs that go to Slurm, each in a Slurm allocation of its own")
    a.set_defaults(fn=cmd_slurm_agent)


def cmd_slurm_agent(args) -> int:
    from trainyard.app.clusters import agent  # here: other commands do not pay for its imports
    return agent.main(get_settings())
