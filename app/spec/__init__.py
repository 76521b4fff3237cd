"""The job spec: everything a client may submit, validated here once for the API and again by the worker.

This package is the single source of truth for job kinds, architectures, datasets, devices, sweeps and the
limits on every field. It imports neither torch nor FastAPI, so the API server stays light. Its modules:
common (the strict base model, dataset and upload names, JSON depth), train (model, data, training
parameters), jobs (the three job kinds, parse_spec), sweep (a search over a job's fields), slurm (what a job
may ask of Slurm, checked against the service's settings: resolve) and catalogue (GET /catalog). Every name is
re-exported here: import from trainyard.app.spec.
"""
from trainyard.app.spec.catalogue import ARCH_INPUTS, catalog
from trainyard.app.spec.common import (
    DATASET_INFO,
    DATASETS,
    MAX_JSON_DEPTH,
    MAX_PARAMS_BYTES,
    UPLOAD_PREFIX,
    Params,
    ShownName,
    _Strict,
    check_dataset,
    check_depth,
    check_upload,
    is_plugin_dataset,
    json_depth,
    uploads_named,
)
from trainyard.app.spec.jobs import (
    BATCH_REF,
    DEVICE_PATTERN,
    FLOAT32_MAX,
    JOB_KINDS,
    MAX_AFTER,
    MAX_BATCH,
    MAX_DEVICES,
    MAX_ID,
    MAX_META_FILE_BYTES,
    MAX_METRIC_KEYS,
    MAX_METRIC_NAME,
    MAX_MODEL_META_BYTES,
    MAX_PREDICT_ROWS,
    PIPELINE_EXAMPLE,
    PREDICT_DATA_EXAMPLE,
    PREDICT_INPUTS_EXAMPLE,
    TRAIN_EXAMPLE,
    JobBatch,
    JobId,
    JobRef,
    JobSpec,
    ModelRef,
    PredictData,
    PredictJob,
    Resources,
    RunJob,
    TrainJob,
    job_spec_adapter,
    parse_spec,
)
from trainyard.app.spec.slurm import SLURM_NAME, SlurmRequest
from trainyard.app.spec.sweep import (
    ANY,
    DEFAULT_TRIALS,
    INTEGER,
    MAX_CHOICE_BYTES,
    MAX_CHOICE_VALUES,
    MAX_GRID_VALUES,
    MAX_RANGE_STEPS,
    MAX_SWEEP_TRIALS,
    NUMBER,
    OTHER,
    SWEEP_METHODS,
    TRAIN_SWEEP_METRICS,
    AshaPruner,
    BaseJob,
    ChoiceParam,
    FloatParam,
    IntParam,
    MedianPruner,
    PrunerSpec,
    SweepParam,
    SweepSpec,
    field_kind,
    range_count,
    with_params,
)
from trainyard.app.spec.train import (
    ACTIVATIONS,
    ALL_ARCHS,
    ARCH_FIELDS,
    ARCHS,
    HIGHER_IS_BETTER,
    MAX_FAKE_BYTES,
    TORCHVISION_ARCHS,
    VAL_METRICS,
    WEIGHTS_PATTERN,
    Augment,
    DataSpec,
    EarlyStopping,
    ModelSpec,
    Schedule,
    TrainParams,
)

# _Strict too: other modules' request models extend it (strict types, unknown fields refused).
__all__ = [
    "ARCH_INPUTS", "catalog", "DATASET_INFO", "DATASETS", "UPLOAD_PREFIX", "MAX_PARAMS_BYTES", "MAX_JSON_DEPTH",
    "ShownName", "_Strict", "check_dataset", "uploads_named", "check_upload", "is_plugin_dataset", "json_depth",
    "check_depth", "Params", "JOB_KINDS", "DEVICE_PATTERN", "MAX_PREDICT_ROWS", "MAX_DEVICES", "MAX_ID",
    "MAX_AFTER", "MAX_BATCH", "BATCH_REF", "JobId", "JobRef", "ModelRef", "JobBatch", "PIPELINE_EXAMPLE",
    "FLOAT32_MAX", "MAX_METRIC_KEYS", "MAX_METRIC_NAME", "MAX_MODEL_META_BYTES", "MAX_META_FILE_BYTES", "Resources",
    "TrainJob", "PredictData", "PredictJob", "RunJob", "JobSpec", "job_spec_adapter", "parse_spec", "TRAIN_EXAMPLE",
    "PREDICT_INPUTS_EXAMPLE", "PREDICT_DATA_EXAMPLE", "SWEEP_METHODS", "MAX_SWEEP_TRIALS", "MAX_GRID_VALUES",
    "DEFAULT_TRIALS", "MAX_CHOICE_VALUES", "MAX_CHOICE_BYTES", "MAX_RANGE_STEPS", "TRAIN_SWEEP_METRICS", "NUMBER",
    "INTEGER", "ANY", "OTHER", "range_count", "FloatParam", "IntParam", "ChoiceParam", "SweepParam", "MedianPruner",
    "AshaPruner", "PrunerSpec", "BaseJob", "SweepSpec", "field_kind", "with_params", "ARCHS", "TORCHVISION_ARCHS",
    "ALL_ARCHS", "ARCH_FIELDS", "ACTIVATIONS", "WEIGHTS_PATTERN", "MAX_FAKE_BYTES", "ModelSpec", "DataSpec",
    "VAL_METRICS", "HIGHER_IS_BETTER", "Schedule", "EarlyStopping", "Augment", "TrainParams",
    "SLURM_NAME", "SlurmRequest",
]
