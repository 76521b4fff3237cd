"""worker/infer.py: predictions on raw inputs, evaluation that agrees with training, input checks."""
import copy
import gzip
import json

import numpy as np
import pytest
import torch

from trainyard.app.spec import TRAIN_EXAMPLE, parse_spec
from trainyard.worker import data, data_sources, infer, train
from trainyard.worker.errors import JobError
from trainyard.worker.job_context import JobContext


def make_ctx(root, name="job"):
    return JobContext(job_id=1, device=torch.device("cpu"), data_dir=root / "data",
                      artifact_dir=root / name / "artifact", checkpoint_path=root / name / "checkpoint.pt")


@pytest.fixture(scope="module")
def iris(tmp_path_factory):
    root = tmp_path_factory.mktemp("iris")
    spec = parse_spec(TRAIN_EXAMPLE)
    ctx = make_ctx(root)
    return spec, train.train(spec, ctx), ctx


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    # Batch norm + a split that is not the default one: evaluation must rebuild both exactly.
    root = tmp_path_factory.mktemp("digits")
    spec = parse_spec({"kind": "train", "model": {"arch": "cnn", "channels": [8, 16]},
                       "data": {"dataset": "digits", "val_fraction": 0.3, "split_seed": 11},
                       "train": {"epochs": 2, "batch_size": 64, "checkpoint_every": 0}})
    ctx = make_ctx(root)
    return spec, train.train(spec, ctx), ctx


def predict_job(**kw):
    return parse_spec({"kind": "predict", "model_job": 1, **kw})


def run(job, trained):
    spec, _summary, train_ctx = trained
    return predicted(job, make_ctx(train_ctx.data_dir.parent, "predict"), train_ctx.artifact_dir, spec)


def predicted(job, ctx, model_dir, spec=None):
    """The whole result, as GET /jobs/{id}/result serves it: the file beside the job's run."""
    summary = infer.predict(job, ctx, model_dir, spec)
    result = json.loads((ctx.artifact_dir / infer.RESULT_FILE).read_text())
    # The job's row keeps the summary: a few numbers, however many rows and classes.
    assert len(json.dumps(summary)) < 500
    if job.inputs is not None:
        assert summary == {"predictions": len(job.inputs), "classes": len(result["class_names"]), "top_k": job.top_k}
    else:
        assert summary == {k: result[k] for k in ("samples", "accuracy", "loss", "dataset", "split")} | \
            {"classes": len(result["class_names"])}
    return result


def test_predict_inputs(iris, tmp_path):
    rows = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]]
    result = run(predict_job(inputs=rows), iris)
    assert result["class_names"] == ["setosa", "versicolor", "virginica"]
    predictions = result["predictions"]
    assert [p["index"] for p in predictions] == [0, 1, 2]
    assert [p["class"] for p in predictions] == ["setosa", "virginica", "versicolor"]
    for p in predictions:
        assert len(p["probabilities"]) == 3 and sum(p["probabilities"]) == pytest.approx(1.0, abs=1e-6)
        assert p["class"] == result["class_names"][int(np.argmax(p["probabilities"]))]


def test_wrong_input_width_is_a_job_error(iris, tmp_path):
    with pytest.raises(JobError, match=r"inputs: each row must have 4 values"):
        run(predict_job(inputs=[[1.0, 2.0, 3.0]]), iris)


@pytest.mark.parametrize("trained", ["iris", "digits"])
def test_evaluate_val_matches_training(trained, request, tmp_path):
    spec, summary, _ = request.getfixturevalue(trained)
    result = run(predict_job(data={"dataset": spec.data.dataset, "split": "val"}), request.getfixturevalue(trained))
    assert result["accuracy"] == summary["val_accuracy"]  # exactly: same model, data and evaluation
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    n_val = len(data.load(spec.data, tmp_path / "d").y_val)
    confusion = np.array(result["confusion_matrix"])
    k = len(summary["class_names"])
    assert confusion.shape == (k, k) and result["samples"] == n_val and confusion.sum() == n_val
    assert np.trace(confusion) / n_val == pytest.approx(result["accuracy"])
    for i, name in enumerate(result["class_names"]):
        total = confusion[i].sum()
        assert result["per_class_accuracy"][name] == (confusion[i, i] / total if total else None)


def test_evaluate_other_splits(iris, tmp_path):
    everything = run(predict_job(data={"dataset": "iris", "split": "all"}), iris)
    assert everything["samples"] == 150 and np.array(everything["confusion_matrix"]).sum(axis=1).tolist() == [50] * 3
    assert run(predict_job(data={"dataset": "iris", "split": "train"}), iris)["samples"] == 120


def test_digits_inputs_are_raw_pixels(digits, tmp_path):
    """Rows of 0..16 pixel values get the training normalisation: predicting the raw validation rows
    gives the same accuracy as evaluating the normalised split."""
    spec, summary, _ = digits
    with gzip.open(data_sources.SHIPPED / "digits.csv.gz", "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    _, val_idx = data.split_indices(len(table), spec.data.val_fraction, spec.data.split_seed)
    rows, labels = table[val_idx, :-1], table[val_idx, -1].astype(int)
    result = run(predict_job(inputs=rows.tolist()), digits)
    predicted = [int(p["class"]) for p in result["predictions"]]
    assert np.mean(np.array(predicted) == labels) == summary["val_accuracy"]


def test_widened_output_layer_gets_named_classes(tmp_path):
    raw = copy.deepcopy(TRAIN_EXAMPLE)
    raw["model"]["num_classes"] = 5
    raw["train"].update(epochs=5, checkpoint_every=0)
    spec = parse_spec(raw)
    ctx = make_ctx(tmp_path)
    summary = train.train(spec, ctx)
    assert summary["num_classes"] == 5
    result = predicted(predict_job(data={"dataset": "iris"}), make_ctx(tmp_path, "p"), ctx.artifact_dir, spec)
    assert result["class_names"] == ["setosa", "versicolor", "virginica", "3", "4"]
    assert np.array(result["confusion_matrix"]).shape == (5, 5)
    assert result["per_class_accuracy"]["3"] is None
    assert result["accuracy"] == summary["val_accuracy"]


def test_dataset_of_another_shape_is_a_job_error(iris, tmp_path):
    with pytest.raises(JobError, match=r"shape \(1, 8, 8\)"):
        run(predict_job(data={"dataset": "digits"}), iris)


def test_evaluate_helper_restores_training_mode():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    loss, accuracy, pred = infer.evaluate(model, torch.randn(5, 2), torch.tensor([0, 1, 0, 1, 0]), 2,
                                          torch.device("cpu"))
    assert model.training and 0 <= accuracy <= 1 and pred.shape == (5,) and loss > 0


def test_training_spec_defaults_to_the_artifacts(iris):
    spec, summary, train_ctx = iris
    job = predict_job(data={"dataset": "iris"})
    result = predicted(job, make_ctx(train_ctx.data_dir.parent, "predict"), train_ctx.artifact_dir)
    assert result["accuracy"] == summary["val_accuracy"]


def test_top_k_returns_the_k_most_likely_classes(iris):
    rows = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]
    full = run(predict_job(inputs=rows), iris)["predictions"]
    top = run(predict_job(inputs=rows, top_k=2), iris)["predictions"]
    for f, t in zip(full, top):
        assert "probabilities" not in t and len(t["top"]) == 2 and t["class"] == f["class"]
        ranked = sorted(range(3), key=lambda i: -f["probabilities"][i])[:2]
        assert [c["class"] for c in t["top"]] == [["setosa", "versicolor", "virginica"][i] for i in ranked]
        assert [c["probability"] for c in t["top"]] == pytest.approx([f["probabilities"][i] for i in ranked])


def test_inputs_that_overflow_inside_the_model_are_a_job_error(iris):
    with pytest.raises(JobError, match="overflow"):
        run(predict_job(inputs=[[5.1, 3.5, 1.4, 0.2], [3e38, -3e38, 3e38, 3e38]]), iris)


def test_no_confusion_matrix_past_the_class_bound(iris, monkeypatch):
    monkeypatch.setattr(infer, "MAX_CONFUSION_CLASSES", 2)
    result = run(predict_job(data={"dataset": "iris", "split": "val"}), iris)
    assert result["confusion_matrix"] is None and "no confusion matrix" in result["note"]
    with_matrix = (monkeypatch.undo(), run(predict_job(data={"dataset": "iris", "split": "val"}), iris))[1]
    m = np.array(with_matrix["confusion_matrix"])
    assert result["per_class_accuracy"] == with_matrix["per_class_accuracy"]
    assert result["per_class_accuracy"]["setosa"] == m[0, 0] / m[0].sum()
