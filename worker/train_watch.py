"""What the evaluated epochs of a training run have shown: the best one kept (`keep: best`) and
early stopping (`early_stopping`: evaluations without improvement, against a patience)."""
import math
from typing import Any

import torch
from torch import nn

from trainyard.app.spec import HIGHER_IS_BETTER, TrainParams
from trainyard.worker import artifacts


class Watch:
    """What the evaluated epochs have shown so far: the best one by keep_metric with its weights
    (keep: best), and how many evaluations the early-stopping metric has gone without improving."""

    def __init__(self, p: TrainParams):
        self.keep_metric = p.keep_metric if p.keep == "best" else None
        self.early = p.early_stopping
        self.best: dict[str, Any] | None = None  # epoch, value and metrics of the best evaluated epoch
        self.best_state: dict[str, torch.Tensor] | None = None
        self.early_best: float | None = None
        self.waited = 0

    def update(self, epoch: int, metrics: dict[str, Any], model: nn.Module) -> bool:
        """Take in an evaluated epoch's metrics; True when early stopping says stop."""
        if self.keep_metric and improves(self.keep_metric, metrics[self.keep_metric],
                                         self.best["value"] if self.best else None, 0.0):
            self.best = {"epoch": epoch, "value": metrics[self.keep_metric],
                         "metrics": {k: metrics[k] for k in ("train_loss", "val_loss", "val_accuracy")}}
            # A copy on the device: no wait for it, and one model's memory at most.
            self.best_state = {k: v.detach().clone() for k, v in artifacts.unwrap(model).state_dict().items()}
        if self.early is None:
            return False
        value = metrics[self.early.metric]
        if improves(self.early.metric, value, self.early_best, self.early.min_delta):
            self.early_best, self.waited = value, 0
        else:
            self.waited += 1
        return self.waited >= self.early.patience

    def why(self) -> str:
        e = self.early
        if e is None:
            return "no early stopping asked for"
        best = "no finite value" if self.early_best is None else f"{self.early_best:.4f}"
        return f"{e.metric} has not improved by more than {e.min_delta} on {best} in " \
               f"{self.waited} evaluation(s) (patience {e.patience})"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_state": self.best_state, "early_best": self.early_best,
                "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.best, self.best_state = state["best"], state["best_state"]
            self.early_best, self.waited = state["early_best"], state["waited"]


def improves(metric: str, value: float, best: float | None, min_delta: float) -> bool:
    if best is None:
        return math.isfinite(value)
    return value > best + min_delta if HIGHER_IS_BETTER[metric] else value < best - min_delta
