"""A sweep's Optuna study: its journal in trainyard's database, the distributions of its parameters, its
sampler and pruner. Optuna decides what each trial tries (grid, random, TPE) and which trials to stop early
(median rule, ASHA); app/sweeps/search.py drives it.

The study lives in trainyard's database as the log of Optuna's JournalStorage (table sweep_log,
written through a backend of our own): one schema under our migrations on SQLite and PostgreSQL
alike, appends fenced by the sweep's driver lease, and any process replays it to carry the sweep on
after a restart. (Optuna's RDBStorage would bring a dozen tables and an Alembic history of its own
into our database, beside ours.)
"""
import json
import warnings
from collections.abc import Iterable
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import BaseJournalBackend
from optuna.study import StudyDirection
from sqlalchemy import func, insert, select
from sqlalchemy.engine import Engine

from trainyard.app.db import read, sweep_log, write
from trainyard.app.spec import ChoiceParam, FloatParam, IntParam, SweepSpec
from trainyard.app.sweeps.sweep_store import fence

optuna.logging.set_verbosity(optuna.logging.WARNING)

STUDY = "sweep"
# A study made by this release holds each choice as an index into its values (study user attr ENCODING):
# Optuna journals every trial's distributions in full, and choices' values (any JSON, thousands of them)
# made each trial's entries megabytes, and the replay a copy per trial. Studies without it (made before)
# hold the values as JSON strings, and are carried on as they were made.
ENCODING = "trainyard.choices"
INDEX = "index"


class LostSweep(Exception):
    """The sweep ended, or another process drives it: this process stops advancing it."""


class Journal(BaseJournalBackend):
    """Optuna's journal of one sweep's study, in table sweep_log; appends fenced by the driver lease."""

    def __init__(self, engine: Engine, sweep_id: int, driver: str):
        self.engine, self.sweep_id, self.driver = engine, sweep_id, driver

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        with read(self.engine) as conn:
            return list(conn.execute(select(sweep_log.c.entry).where(
                sweep_log.c.sweep_id == self.sweep_id, sweep_log.c.seq >= log_number_from)
                .order_by(sweep_log.c.seq)).scalars())

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        with write(self.engine) as conn:
            if not fence(conn, self.sweep_id, self.driver):
                raise LostSweep(f"sweep {self.sweep_id} is no longer driven by {self.driver}")
            seq = conn.execute(select(func.coalesce(func.max(sweep_log.c.seq) + 1, 0))
                               .where(sweep_log.c.sweep_id == self.sweep_id)).scalar_one()
            conn.execute(insert(sweep_log), [dict(sweep_id=self.sweep_id, seq=seq + i, entry=entry)
                                             for i, entry in enumerate(logs)])


def open_study(engine: Engine, sweep_id: int, driver: str, spec: SweepSpec) -> optuna.Study:
    """The sweep's study, replayed from its journal, or made (on the sweep's first pass)."""
    storage = JournalStorage(Journal(engine, sweep_id, driver))
    if storage.get_all_studies():
        study = optuna.load_study(study_name=STUDY, storage=storage)
    else:
        study = optuna.create_study(study_name=STUDY, storage=storage, direction=direction(spec))
        study.set_user_attr(ENCODING, INDEX)
    study.pruner = pruner(spec)
    return study


def direction(spec: SweepSpec) -> StudyDirection:
    return StudyDirection.MAXIMIZE if spec.goal == "maximize" else StudyDirection.MINIMIZE


def distributions(spec: SweepSpec, index: bool = True) -> tuple[dict[str, BaseDistribution], dict[str, list]]:
    """Optuna's distribution of each parameter, and the values of those that are choices (a grid searches
    every parameter's values): a choice's distribution is over the indices of its values, or (index False,
    a study made before) over the values as JSON strings, Optuna's categorical values being scalars."""
    grid = spec.grid() if spec.method == "grid" else None
    dists: dict[str, BaseDistribution] = {}
    values: dict[str, list] = {}
    for path, p in spec.parameters.items():
        if grid is not None:
            values[path] = grid[path]
        elif isinstance(p, ChoiceParam):
            values[path] = p.values
        if path in values:
            dists[path] = CategoricalDistribution(list(range(len(values[path]))) if index
                                                  else [json.dumps(v) for v in values[path]])
        elif isinstance(p, FloatParam):
            dists[path] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            dists[path] = IntDistribution(p.low, p.high, log=p.log, step=p.step)
    return dists, values


def decode(dists: dict[str, BaseDistribution], values: dict[str, list], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's values as the job takes them: a choice's value from its index (or its JSON string)."""
    def value(path, v):
        if path not in values:
            return v
        return json.loads(v) if isinstance(v, str) else values[path][v]
    return {path: value(path, v) for path, v in params.items()}


def suggest(trial: optuna.Trial, dists: dict[str, BaseDistribution]) -> None:
    """Draw each parameter the trial has not drawn yet (all of a new trial's): study.ask(dists), also for a
    trial whose drawing a stopped process left half done. A parameter drawn already keeps its value."""
    for path, d in dists.items():
        if isinstance(d, CategoricalDistribution):
            trial.suggest_categorical(path, d.choices)
        elif isinstance(d, IntDistribution):
            trial.suggest_int(path, d.low, d.high, step=d.step, log=d.log)
        elif isinstance(d, FloatDistribution):
            trial.suggest_float(path, d.low, d.high, step=d.step, log=d.log)


def sampler(spec: SweepSpec, dists: dict[str, BaseDistribution], made: int) -> optuna.samplers.BaseSampler:
    """Seeded by the sweep's seed and the trials made so far: a sweep carried on by another process
    after a restart draws what an uninterrupted one would have, given the same results."""
    seed = (spec.seed * 1_000_003 + made) % 2**32
    if spec.method == "grid":
        # Its seed shuffles the grid, whose ids its trials hold: the same seed for every instance.
        return optuna.samplers.GridSampler({p: d.choices for p, d in dists.items()
                                            if isinstance(d, CategoricalDistribution)}, seed=spec.seed)
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # constant_liar: trials still running count as poor guesses, so concurrent asks spread out.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=spec.startup_trials, constant_liar=True)


def pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    if p is None:
        return optuna.pruners.NopPruner()
    if p.type == "median":
        # Steps are 1-based epochs and Optuna prunes from step n_warmup_steps on: no decision until
        # warmup_epochs have ended.
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_epochs + 1,
                                           interval_steps=p.interval_epochs)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=p.min_epochs, reduction_factor=p.reduction_factor)
