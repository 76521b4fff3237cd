"""A job's whole result as GET /jobs/{id}/result answers it: a train job's summary (worker/train_report.py), a
prediction's rows or an evaluation's scores (worker/infer.py's result.json), or what a run job's entrypoint
returned (worker/entrypoints.py). These models document the answer only: the route sends the stored JSON as it
is, so adding a field here adds none to the wire.

The result carries no field naming its kind, so the union has no discriminator: each typed member requires the
fields its worker always writes (a prediction's `predictions` rows, an evaluation's `confusion_matrix`, a train
job's `epochs`), and a run job's free-form object comes last. Generated clients try the members in this order."""
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel


class PredictionTop(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)
    class_: str = Field(alias="class")
    probability: float


class PredictionRow(BaseModel):
    """One input row's prediction: every class's probability, or (with the spec's top_k) the most probable few."""
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)
    index: int = Field(description="the row's place in the spec's inputs")
    class_: str = Field(alias="class", description="the most probable class")
    probabilities: list[float] | None = Field(None, description="each class's, in class_names' order (no top_k)")
    top: list[PredictionTop] | None = Field(None, description="the top_k classes, most probable first (top_k)")


class PredictionResult(BaseModel):
    """A predict job's on the spec's inputs."""
    predictions: list[PredictionRow] = Field(description="one per input row, in order")
    class_names: list[str] = Field(description="the model's outputs' names")


class EvaluationResult(BaseModel):
    """A predict job's on a dataset's split (spec.data)."""
    samples: int
    accuracy: float
    loss: float = Field(description="mean cross-entropy")
    classes: int
    dataset: str
    split: str
    per_class_accuracy: dict[str, float | None] = Field(description="by class name; null for a class with no sample")
    confusion_matrix: list[list[int]] | None = Field(description="counts[true class][predicted class]; null past "
                                                                 "1000 classes (see note)")
    class_names: list[str]
    note: str | None = Field(None, description="why the confusion matrix is left out")


class TrainResult(BaseModel):
    """A train job's: the kept epoch's metrics and what the run was."""
    epochs: int = Field(description="the epochs asked for")
    train_loss: float | None
    val_loss: float | None
    val_accuracy: float | None
    samples_per_s: float | None = Field(None, description="mean over the epochs run")
    input_shape: list[int]
    num_classes: int = Field(description="the model's outputs")
    class_names: list[str]
    parameters: int | None = None
    devices: int | None = Field(None, description="ranks the job ran on")
    peak_memory_allocated: int | None = Field(None, description="bytes (CUDA only)")
    peak_memory_reserved: int | None = Field(None, description="bytes (CUDA only)")
    applied: dict[str, Any] | None = Field(None, description="the speed switches as really applied")
    resumed_from_epoch: int | None = None
    resumed_from_step: int | None = None
    kept: str | None = Field(None, description="which epoch's weights are kept (train.keep)")
    kept_epoch: int | None = None
    stopped_early_at: int | None = None
    started_from: dict[str, Any] | None = Field(None, description="the weights it started from (null: a fresh init)")


class RunResult(BaseModel):
    """A run job's: the JSON object its entrypoint returned ({"value": ...} for any other value)."""
    model_config = ConfigDict(extra="allow")


class FullJobResult(RootModel[PredictionResult | EvaluationResult | TrainResult | RunResult]):
    """A job's whole result, by its kind: predict on inputs, predict on a dataset, train, run."""
