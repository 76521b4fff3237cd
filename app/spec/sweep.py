"""A sweep: a search over a base job's fields (app/sweeps/search.py runs it). Its parameters and pruners, and the
helpers that read and set a job's fields by dotted path."""
import json
import math
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, field_validator, model_validator

from trainyard.app.spec.common import MAX_JSON_DEPTH, ShownName, _Strict, json_depth
from trainyard.app.spec.jobs import RunJob, TrainJob
from trainyard.app.spec.train import HIGHER_IS_BETTER

SWEEP_METHODS = ("grid", "random", "tpe")
MAX_SWEEP_TRIALS = 1000
MAX_GRID_VALUES = 10_000  # a parameter's values the grid enumerates (an int range's length, say)
DEFAULT_TRIALS = 20  # a random or tpe sweep's trials without max_trials
# A sweep's choice values, all its parameters together: each is checked as a whole job at submit, and
# the study holds each trial's choice of them (app/sweeps/study.py journals an index into them, not the value).
MAX_CHOICE_VALUES = 1000
MAX_CHOICE_BYTES = 256 << 10
# Steps of a float range with a step: Optuna counts them in 28-digit decimals, and a grid enumerates them.
MAX_RANGE_STEPS = 2**53
TRAIN_SWEEP_METRICS = ("val_loss", "val_accuracy", "train_loss")
# A path ends in a number, a number or anything (below a plugin's params or a run job's config), or else.
NUMBER, INTEGER, ANY, OTHER = "number", "integer", "any", "other"


def range_count(low: float, high: float, step: float) -> int:
    """How many values a stepped range holds, low and high included (1e-9: (0.3 - 0.1) / 0.1 < 2)."""
    return int(math.floor((high - low) / step + 1e-9)) + 1


class FloatParam(_Strict):
    type: Literal["float"]
    low: float
    high: float
    log: bool = Field(False, description="sample on a log scale (low > 0)")
    step: float | None = Field(None, gt=0, description="a grid of low, low + step, ... high")

    @model_validator(mode="after")
    def _range(self):
        _check_range(self.low, self.high, self.log, self.step)
        if not math.isfinite(self.high - self.low):
            raise ValueError(f"the range from {self.low} to {self.high} is wider than a float holds; narrow it")
        if self.step is not None and not (self.high - self.low) / self.step <= MAX_RANGE_STEPS:
            raise ValueError(f"step {self.step} makes over {MAX_RANGE_STEPS:,} steps from low to high; "
                             "take a larger step")
        return self


class IntParam(_Strict):
    type: Literal["int"]
    low: int = Field(ge=-2**53, le=2**53)
    high: int = Field(ge=-2**53, le=2**53)
    log: bool = Field(False, description="sample on a log scale (low >= 1)")
    step: int = Field(1, ge=1, le=2**53)

    @model_validator(mode="after")
    def _range(self):
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self


class ChoiceParam(_Strict):
    type: Literal["choice"]
    values: list[Any] = Field(min_length=1, max_length=MAX_CHOICE_VALUES,
                              description="the values to choose from: any JSON the field takes (lists too), "
                              "nested at most 32 deep")

    @field_validator("values")
    @classmethod
    def _distinct(cls, v: list) -> list:
        for i, x in enumerate(v):
            if json_depth(x) > MAX_JSON_DEPTH:
                raise ValueError(f"values[{i}] nests lists or objects more than {MAX_JSON_DEPTH} deep")
        encoded = [json.dumps(x, sort_keys=True) for x in v]
        if len(set(encoded)) != len(encoded):
            raise ValueError("values repeat; give each value once")
        return v


def _check_range(low, high, log, step) -> None:
    if not low <= high:
        raise ValueError(f"low ({low}) must not be above high ({high})")
    if log and low <= 0:
        raise ValueError("log scale needs low > 0")
    if log and step is not None:
        raise ValueError("a log-scale range takes no step")


SweepParam = Annotated[FloatParam | IntParam | ChoiceParam, Field(discriminator="type")]


class MedianPruner(_Strict):
    """Stop a trial whose metric at an epoch is worse than the median of earlier trials' at that epoch."""
    type: Literal["median"]
    startup_trials: int = Field(3, ge=0, le=MAX_SWEEP_TRIALS, description="trials that end before any is pruned")
    warmup_epochs: int = Field(1, ge=0, le=100_000, description="epochs a trial runs before any pruning decision")
    interval_epochs: int = Field(1, ge=1, le=100_000, description="epochs between pruning checks")


class AshaPruner(_Strict):
    """Asynchronous successive halving: at epochs min_epochs x reduction_factor^k a trial carries on only if
    it is in the best 1/reduction_factor of the trials that reached that epoch."""
    type: Literal["asha"]
    min_epochs: int = Field(1, ge=1, le=100_000, description="the first rung's epoch")
    reduction_factor: int = Field(3, ge=2, le=100, description="1 in reduction_factor trials is promoted")


PrunerSpec = Annotated[MedianPruner | AshaPruner, Field(discriminator="type")]
BaseJob = Annotated[TrainJob | RunJob, Field(discriminator="kind")]


class SweepSpec(_Strict):
    """A search over a base job's fields: each trial is the base job with the trial's values set."""
    name: ShownName | None = None
    job: BaseJob = Field(description="the base job: a train job or a run job")
    parameters: dict[ShownName, SweepParam] = Field(
        min_length=1, max_length=32, description="search space by dotted path into the job: train.lr, model.hidden, "
        "config.width (a run job's config)...")
    method: Literal[SWEEP_METHODS] = Field("tpe", description="grid: every combination; random; tpe: Optuna's "  # type: ignore[valid-type]
                                           "Tree-structured Parzen Estimator")
    metric: str = Field("val_loss", pattern=r"^[A-Za-z0-9_.\-]{1,100}$",
                        description="the per-epoch metric to optimise (train jobs: val_loss, val_accuracy, train_loss)")
    direction: Literal["minimize", "maximize"] | None = Field(
        None, description="default: maximize val_accuracy, minimize anything else")
    max_trials: int | None = Field(None, ge=1, le=MAX_SWEEP_TRIALS,
                                   description="trials to run (default: the grid's size, or 20)")
    max_concurrent: int = Field(4, ge=1, le=256, description="trials queued or running at once")
    pruner: PrunerSpec | None = Field(None, description="stop poor trials early (median rule or ASHA)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="the sampler's seed")
    startup_trials: int = Field(10, ge=1, le=MAX_SWEEP_TRIALS, description="tpe: random trials before the model "
                                "of good and bad settings guides the search")
    max_failed_trials: int = Field(5, ge=1, le=MAX_SWEEP_TRIALS, description="trials that fail (not pruned or "
                                   "cancelled) before the sweep gives up")
    keep_best: int | None = Field(None, ge=0, le=MAX_SWEEP_TRIALS, description="once the sweep ends, only its "
                                  "best k trials keep their files (model, checkpoints, log); 0 keeps every "
                                  "trial's (default: TRAINYARD_SWEEP_KEEP_BEST)")

    @model_validator(mode="after")
    def _base_waits_for_nothing(self):
        # A sweep's trials are made over time by its driver, outside any submit: none of them could wait.
        if self.job.after:
            raise ValueError("job.after: a sweep's trials cannot wait for jobs; submit the sweep once they succeed")
        return self

    @property
    def goal(self) -> str:
        """The direction: as given, or maximize for a metric that grows better (val_accuracy)."""
        return self.direction or ("maximize" if HIGHER_IS_BETTER.get(self.metric) else "minimize")

    @property
    def trials(self) -> int:
        """Trials to make: max_trials, 20 by default; a grid's size at most (each combination once)."""
        if self.method == "grid":
            return min(self.grid_size(), self.max_trials or MAX_SWEEP_TRIALS)
        return self.max_trials or DEFAULT_TRIALS

    def grid(self) -> dict[str, list]:
        """Every parameter's values, for the grid: choices, int ranges, and float ranges with a step."""
        out = {}
        for path, p in self.parameters.items():
            if isinstance(p, ChoiceParam):
                out[path] = p.values
                continue
            step = p.step  # None only for a float range without one (an int range steps by 1 at least)
            if p.log or step is None:
                raise ValueError(f"parameters.{path}: a grid takes choices, int ranges and float ranges with a step; "
                                 "this range has no finite set of values")
            n = range_count(p.low, p.high, step)
            if n > MAX_GRID_VALUES:
                raise ValueError(f"parameters.{path}: {n:,} values is over the grid's {MAX_GRID_VALUES:,}")
            out[path] = [p.low + i * step for i in range(n)] if isinstance(p, IntParam) \
                else [round(p.low + i * step, 12) for i in range(n)]
        return out

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid().values())


def field_kind(path: str, job_kind: str) -> str:
    """What the field at a dotted path of a job holds (NUMBER, INTEGER, ANY, OTHER); ValueError if no such field."""
    model: Any = TrainJob if job_kind == "train" else RunJob
    parts = path.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None or part in ("kind", "name"):
            raise ValueError(f"{path!r} is not a field of a {job_kind} job"
                             + (f" (no {part!r} in {'.'.join(parts[:i]) or 'the job'})" if i else ""))
        inner = _unwrap(field.annotation)
        last = i == len(parts) - 1
        if last:
            return INTEGER if inner is int else NUMBER if inner is float else OTHER
        if get_origin(inner) is dict or inner is dict:
            if part not in ("params", "config"):
                break
            return ANY  # a plugin's params or a run job's config: free-form below this
        model = inner
    raise ValueError(f"{path!r} is not a field of a {job_kind} job")


def _unwrap(annotation):
    """X from Optional[X] and Annotated[X, ...]; a union of models stays a union (not walked)."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def with_params(job: dict, params: dict[str, Any]) -> dict:
    """The base job (its JSON) with each dotted path set to its value; missing objects on a path are made."""
    out = json.loads(json.dumps(job))
    for path, value in params.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return out
