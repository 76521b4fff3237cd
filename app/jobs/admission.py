"""Admission: what a well-formed job must also satisfy, against the service's state, before it is queued.

The spec (app/spec/) checks a job on its own. Here it is checked against what exists: the
dataset it names, the plugins it needs (installed here or on a live worker), the model job a
prediction uses or a training starts from (init_from), the jobs it waits for (after; a model job still
queued or running is waited for too, and a batch's "$N" names its earlier jobs), and the limits that
keep one small request from costing the service gigabytes (parameters of the model, values a
prediction returns). The submitter's project's limits on its jobs (app/accounts/quotas.py) are checked later, in the
transaction that inserts them (app/jobs/submit.py). The answer says what the job needs of the worker that will claim it.
"""
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from sqlalchemy.engine import Engine

from trainyard.app import uploads
from trainyard.app.accounts import Principal
from trainyard.app.core.errors import Invalid, NotFound
from trainyard.app.core.layout import ARTIFACT_FILES
from trainyard.app.core.settings import Settings
from trainyard.app.core.states import JobState
from trainyard.app.fleet import dependencies
from trainyard.app.fleet.plugin_catalog import known_plugins, plugin_catalog  # noqa: F401 - GET /catalog reads it here
from trainyard.app.records import visibility
from trainyard.app.spec import (
    ALL_ARCHS,
    DATASET_INFO,
    DATASETS,
    MAX_META_FILE_BYTES,
    UPLOAD_PREFIX,
    DataSpec,
    ModelSpec,
    PredictJob,
    RunJob,
    TrainJob,
    is_plugin_dataset,
    model_size,
)
from trainyard.app.spec import slurm as slurm_spec


@dataclass
class Admitted:
    parameters: int | None = None                            # the model's size, when it can be counted here
    needs: dict[str, str] = field(default_factory=dict)     # plugin kind -> name the claiming worker must have


class Check:
    """One submission's admission: the plugins it may name are read once. waits: the job may wait for jobs
    (a job's submit; a sweep's trials may not); batch: the batch's jobs before this one (it is at len(batch));
    who: whom it is submitted as (a job of another project does not exist for them; None: no one's, all exist)."""

    def __init__(self, engine: Engine, settings: Settings, waits: bool = False,
                 batch: list[TrainJob | PredictJob | RunJob] | None = None, who: Principal | None = None):
        self.engine, self.settings, self.waits, self.batch, self.who = engine, settings, waits, batch, who
        self._known: dict | None = None

    def after(self, spec: TrainJob | PredictJob | RunJob) -> None:
        """Each job in `after` exists (or is an earlier job of the batch) and may still succeed."""
        for at, ref in ((("after", k), ref) for k, ref in enumerate(spec.after)):
            if isinstance(ref, str):
                dependencies.batch_position(ref, None if self.batch is None else len(self.batch), at)
                continue
            try:
                job = visibility.job_for(self.engine, self.who, ref)
            except NotFound:
                raise Invalid(f"after: job {ref} does not exist", loc=at) from None
            if job.state in dependencies.NEVER:
                raise Invalid(f"after: job {ref} is {job.state}; it will not succeed (retry it first)", loc=at)

    @property
    def known(self) -> dict[str, dict[str, list[str]]]:
        if self._known is None:
            self._known = known_plugins(self.engine, self.settings)
        return self._known

    def plugin(self, kind: str, name: str, loc: tuple, builtins: tuple[str, ...], admitted: Admitted) -> None:
        if name not in self.known[kind]:
            installed = ", ".join(sorted(self.known[kind])) or "none"
            valid = f"{', '.join(builtins)}, or " if builtins else ""
            raise Invalid(f"unknown {_WHAT[kind]} {name!r}; valid: {valid}an installed {kind[:-1]} plugin "
                          f"(installed: {installed})", loc=loc)
        admitted.needs[kind] = name

    def dataset(self, data: DataSpec, loc: tuple, admitted: Admitted) -> tuple[tuple[int, ...], int] | None:
        """(input shape per sample, number of classes) without loading it; None for a plugin's."""
        if is_plugin_dataset(data.dataset):
            self.plugin("datasets", data.dataset, loc, (*DATASETS, "upload:<id>"), admitted)
            return None
        if data.dataset == "fake":
            return tuple(data.image_size), data.num_classes
        if data.dataset.startswith(UPLOAD_PREFIX):
            try:
                meta = uploads.get(self.settings.store, data.dataset[len(UPLOAD_PREFIX):], who=self.who)
            except NotFound:
                raise Invalid(f"dataset {data.dataset!r} does not exist (GET /datasets lists the uploads)",
                              loc=loc) from None
            return tuple(meta["input_shape"]), len(meta["classes"])
        info = DATASET_INFO[data.dataset]
        return tuple(info["input_shape"]), info["classes"]

    def train(self, spec: TrainJob) -> Admitted:
        """The model's parameter count, once its dataset and plugins exist and it is within max_parameters.
        A plugin's model (or a model on a plugin's data) is not counted: it is built on the worker only."""
        admitted = Admitted()
        shape = self.dataset(spec.data, ("data", "dataset"), admitted)
        if spec.model.is_plugin:
            self.plugin("models", spec.model.arch, ("model", "arch"), ALL_ARCHS, admitted)
        elif shape is not None:
            admitted.parameters = n = model_size.parameter_count(spec.model, *shape)
            if n > self.settings.max_parameters:
                raise Invalid(f"{spec.model.arch} on {spec.data.dataset} has {n:,} parameters; the limit is "
                              f"{self.settings.max_parameters:,} (TRAINYARD_MAX_PARAMETERS)", loc=("model",))
        if spec.init_from is not None:
            self.starting_point(spec, spec.init_from, shape[0] if shape else None)
        self.after(spec)
        return admitted

    def starting_point(self, spec: TrainJob, init_from: int | str, input_shape: tuple[int, ...] | None) -> None:
        """init_from names a model of the same architecture, weight-shaping fields and input shape: only the
        classifier head may differ (its number of classes), and the worker re-makes it. A run job still to
        save its model is checked by the worker."""
        at, source = ("init_from",), self.model_of(init_from, "init_from")
        if not source:
            return
        if source["arch"] != spec.model.arch:
            raise Invalid(f"init_from job {spec.init_from} is a {source['arch']} model; this job's model is a "
                          f"{spec.model.arch} (fine-tuning keeps the architecture)", loc=at)
        try:
            theirs = _shaping(ModelSpec.model_validate(source.get("model") or {}))
        except ValidationError:  # a run job's own meta: the worker compares the weights themselves
            theirs = _shaping(spec.model)
        for name, value in _shaping(spec.model).items():
            if theirs.get(name) != value:
                raise Invalid(f"init_from job {spec.init_from}'s model has {name} {theirs.get(name)}; this job's has "
                              f"{value} (only the classifier head may differ)", loc=at)
        if input_shape and source.get("input_shape") and tuple(source["input_shape"]) != tuple(input_shape):
            raise Invalid(f"init_from job {spec.init_from} was trained on inputs of shape {list(source['input_shape'])}"
                          f"; {spec.data.dataset} has {list(input_shape)}", loc=at)

    def run(self, spec: RunJob) -> Admitted:
        admitted = Admitted()
        self.plugin("entrypoints", spec.entrypoint, ("entrypoint",), (), admitted)
        self.after(spec)
        return admitted

    def predict(self, spec: PredictJob) -> Admitted:
        """A predict job must name a succeeded job with a model, its inputs must have the model's width,
        and its output (rows x probabilities per row) must stay within max_predict_values."""
        admitted = Admitted()
        model = self.model_of(spec.model_job)
        self.after(spec)
        if model.get("arch") and model["arch"] not in ALL_ARCHS:
            self.plugin("models", model["arch"], ("model_job",), ALL_ARCHS, admitted)
        if spec.data is not None:
            self.dataset(DataSpec(dataset=spec.data.dataset, params=spec.data.params), ("data", "dataset"), admitted)
            return admitted
        inputs = spec.inputs or []  # the spec gives inputs where it gives no data
        width = math.prod(model["input_shape"]) if model.get("input_shape") else None
        if width is not None and len(inputs[0]) != width:
            raise Invalid(f"inputs rows have {len(inputs[0])} values; model_job {spec.model_job} takes {width} "
                          f"(input shape {list(model['input_shape'])})", loc=("inputs",))
        classes = model.get("num_classes") or 0
        per_row = min(spec.top_k, classes) if spec.top_k else classes
        if len(inputs) * per_row > self.settings.max_predict_values:
            raise Invalid(f"{len(inputs)} rows x {per_row} probabilities is over the limit of "
                          f"{self.settings.max_predict_values:,} values a prediction returns "
                          f"(TRAINYARD_MAX_PREDICT_VALUES); send fewer rows or set top_k", loc=("inputs",))
        return admitted

    def model_of(self, job_id: int | str, field: str = "model_job") -> dict:
        """What the model job named by `field` holds: arch, model (its ModelSpec fields), input_shape,
        num_classes (from the job or its meta.json). Of a job yet to succeed (waited for), what its spec says:
        a train job's arch and model; nothing of a run job's, or of a running sweep's best trial."""
        at = (field,)
        if isinstance(job_id, str) and job_id.startswith("sweep:"):
            best = dependencies.sweep_at_submit(self.engine, job_id, at, self.waits, self.who)
            if best is None:  # the sweep runs: its trials' fields vary, so its best is checked by the worker
                return {}
            job_id = best
        if isinstance(job_id, str):
            n = dependencies.batch_position(job_id, None if self.batch is None else len(self.batch), at)
            pending = (self.batch or [])[n]
            return self._pending(pending.kind, pending.model_dump(mode="json"), job_id, at)
        try:
            job = visibility.job_for(self.engine, self.who, job_id)
        except NotFound:
            raise Invalid(f"{field} {job_id} does not exist", loc=at) from None
        if job.state != JobState.SUCCEEDED:
            if not self.waits or job.state not in (JobState.QUEUED, JobState.RUNNING):
                also = " or still be queued or running" if self.waits else ""
                raise Invalid(f"{field} {job_id} is {job.state}; it must have succeeded{also}", loc=at)
            return self._pending(job.kind, job.spec, job_id, at)
        if job.reclaimed and not job.artifact_path:
            raise Invalid(f"{field} {job_id}'s model was removed by retention: {job.reclaimed.get('why')}", loc=at)
        if job.kind == "predict":
            raise Invalid(f"{field} {job_id} is a predict job, not a train job (or a run job that saved a model)",
                          loc=at)
        if job.kind == "train":
            return {"arch": job.spec["model"]["arch"], "model": job.spec["model"], **(job.result or {})}
        key = f"{job.artifact_path or '.'}/{ARTIFACT_FILES['meta']}"
        try:
            size = self.settings.store.size(key)
        except OSError:
            size = 0
        if size > MAX_META_FILE_BYTES:  # saved before the bound: every submit naming it would read it whole
            raise Invalid(f"{field} {job_id}'s meta.json is {size:,} bytes, over the {MAX_META_FILE_BYTES >> 20} MiB "
                          "a model's meta may hold", loc=at)
        try:
            saved = json.loads(self.settings.store.read_bytes(key)) if size else {}
        except (OSError, ValueError):
            saved = {}
        if not (saved.get("model") or {}).get("arch") or not saved.get("input_shape"):
            raise Invalid(f"{field} {job_id} is a run job that saved no model trainyard can rebuild "
                          "(ctx.save_model with arch, input_shape and class_names)", loc=at)
        return {"arch": saved["model"]["arch"], "model": saved["model"], "input_shape": saved["input_shape"],
                "num_classes": saved["num_classes"]}

    @staticmethod
    def _pending(kind: str, spec: dict, ref: int | str, at: tuple) -> dict:
        if kind == "predict":
            raise Invalid(f"{at[0]} {ref} is a predict job, not a train job (or a run job that saved a model)", loc=at)
        return {"arch": spec["model"]["arch"], "model": spec["model"]} if kind == "train" else {}


# What shapes a built-in model's weights besides its head, with the defaults worker/nets.py builds
# (activation and dropout do not); a plugin's params may shape anything.
_SHAPING: dict[str, dict[str, Any]] = {"mlp": {"hidden": [64]},
                                       "cnn": {"channels": [32, 64], "kernel_size": 3, "batch_norm": True}}


def _shaping(model: ModelSpec) -> dict:
    if model.is_plugin:
        return {"params": model.params or {}}
    return {name: default if getattr(model, name) is None else getattr(model, name)
            for name, default in _SHAPING.get(model.arch, {}).items()}


_WHAT = {"models": "architecture", "datasets": "dataset", "entrypoints": "entrypoint"}


def admit(engine: Engine, settings: Settings, spec: TrainJob | PredictJob | RunJob, waits: bool = False,
          batch: list[TrainJob | PredictJob | RunJob] | None = None, who: Principal | None = None) -> Admitted:
    """waits: the job may wait for jobs (its submit; not a sweep's); batch: the batch's jobs before it; who: the
    submitter, who sees only its project's jobs (None: the service itself)."""
    slurm_spec.resolve(spec, settings)  # where it runs: Slurm only where the service offers it
    check = Check(engine, settings, waits, batch, who)
    if isinstance(spec, TrainJob):
        return check.train(spec)
    if isinstance(spec, PredictJob):
        return check.predict(spec)
    return check.run(spec)


def admit_batch(engine: Engine, settings: Settings, specs: list[TrainJob | PredictJob | RunJob],
                who: Principal | None = None) -> list[Admitted]:
    """Each job of a batch (POST /jobs/batch); a field at fault is named within the list ([1, "model_job"])."""
    found = []
    for i, spec in enumerate(specs):
        try:
            found.append(admit(engine, settings, spec, waits=True, batch=specs[:i], who=who))
        except Invalid as e:
            raise Invalid(str(e), loc=(i, *(e.loc or ()))) from None
    return found
