"""How the built-in loop fits a model (worker/train.py, worker/schedule.py): learning-rate schedules,
gradient clipping and accumulation, label smoothing, evaluation cadence, early stopping, keeping the
best epoch and the time-based checkpoint cadence; each tested for its effect, in-process on the CPU."""
import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from tests.helpers.runner import make_ctx, of_type, train_spec, weights
from trainyard.app.spec import TRAIN_EXAMPLE, parse_spec
from trainyard.worker import artifacts, infer, train
from trainyard.worker.errors import Preempted

# TRAIN_EXAMPLE (iris, 120 training samples in one batch of 120): one optimizer step per epoch.
LR = 0.01


def lrs(events) -> list[float]:
    return [e["lr"] for e in of_type(events, "epoch")]


def run(tmp_path, name="run", **params):
    events = []
    result = train.train(train_spec(**params), make_ctx(tmp_path, events, name))
    return result, events


@pytest.mark.parametrize("schedule, expected", [
    (None, [LR] * 5),
    ({"name": "step", "step_epochs": 2, "gamma": 0.5}, [LR, LR, LR / 2, LR / 2, LR / 4]),
    ({"name": "linear", "min_lr": 0.001}, [0.01, 0.00775, 0.0055, 0.00325, 0.001]),
    ({"name": "cosine", "min_lr": 0.001},
     [0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(5)]),
    ({"name": "constant", "warmup_epochs": 2}, [LR / 3, 2 * LR / 3, LR, LR, LR]),
    ({"name": "cosine", "warmup_epochs": 1}, [LR / 2, LR, LR * 0.75, LR * 0.25, 0.0]),
])
def test_each_schedule_sets_the_learning_rate_of_each_epoch(tmp_path, schedule, expected):
    _, events = run(tmp_path, epochs=5, lr=LR, lr_schedule=schedule)
    assert lrs(events) == pytest.approx(expected, abs=1e-12)


def test_onecycle_rises_to_lr_and_anneals_far_below_it(tmp_path):
    _, events = run(tmp_path, epochs=10, lr=LR, lr_schedule={"name": "onecycle", "warmup_epochs": 3})
    seen = lrs(events)
    assert seen[0] == pytest.approx(LR / 25)  # torch's OneCycleLR: starts at max_lr / div_factor
    assert max(seen) == pytest.approx(LR) and seen.index(max(seen)) == 3
    assert seen[-1] < LR / 1000 and seen == sorted(seen[:4]) + sorted(seen[4:], reverse=True)


def test_steps_per_epoch_count_optimizer_steps_with_accumulation(tmp_path):
    # 120 samples in batches of 10, 4 per optimizer step: 3 steps per epoch; linear decay over 6 steps.
    _, events = run(tmp_path, epochs=2, lr=LR, batch_size=10, accumulate_steps=4,
                    lr_schedule={"name": "linear"})
    assert lrs(events) == pytest.approx([LR * 3 / 5, 0.0], abs=1e-12)
    assert {e["effective_batch"] for e in of_type(events, "epoch")} == {40}


@pytest.mark.parametrize("small, k, big", [(10, 4, 40), (16, 2, 32)])
def test_accumulating_k_batches_of_b_equals_one_batch_of_k_times_b(tmp_path, small, k, big):
    # 120 samples: 10 x 4 makes three full groups; 16 x 2 ends with a group of 16 + 8 against a batch of 24.
    common = {"epochs": 3, "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "checkpoint_every": 0}
    a, a_events = run(tmp_path, "a", batch_size=small, accumulate_steps=k, **common)
    b, b_events = run(tmp_path, "b", batch_size=big, **common)
    wa, wb = weights(tmp_path / "a" / "artifact"), weights(tmp_path / "b" / "artifact")
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-6)
    assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    # The same weights are not two untouched models: they moved.
    assert of_type(b_events, "epoch")[-1]["train_loss"] < of_type(b_events, "epoch")[0]["train_loss"]
    # The weights differ from a run that steps on every small batch.
    c, _ = run(tmp_path, "c", batch_size=small, **common)
    assert c["val_loss"] != pytest.approx(a["val_loss"], rel=1e-5)


def test_clipping_bounds_the_gradient_norm(tmp_path):
    spec = train_spec(epochs=1, lr=1.0, grad_clip_norm=0.05)
    r = train.build(spec, make_ctx(tmp_path, []))
    train.step_on(r, r.data.x_train, r.data.y_train)
    norm = nn.utils.get_total_norm([p.grad for p in r.model.parameters()])
    assert norm == pytest.approx(0.05, rel=1e-4)
    pre_clip = r.take_grad_norm()["grad_norm"]
    assert pre_clip > 0.5  # the raw gradient was an order of magnitude larger

    unclipped = train.build(train_spec(epochs=1, lr=1.0), make_ctx(tmp_path, [], "plain"))
    train.step_on(unclipped, unclipped.data.x_train, unclipped.data.y_train)
    assert nn.utils.get_total_norm([p.grad for p in unclipped.model.parameters()]) == pytest.approx(pre_clip)

    _, events = run(tmp_path, "job", epochs=3, grad_clip_norm=0.05)
    assert all(e["grad_norm"] > 0.05 for e in of_type(events, "epoch"))


def test_label_smoothing_is_in_the_training_loss(tmp_path):
    spec = train_spec(epochs=1, label_smoothing=0.3)
    r = train.build(spec, make_ctx(tmp_path, [], "build"))
    with torch.no_grad():
        logits = r.model(r.data.x_train)
    smoothed = nn.functional.cross_entropy(logits, r.data.y_train, label_smoothing=0.3).item()
    plain = nn.functional.cross_entropy(logits, r.data.y_train).item()
    # One full-batch step per epoch: epoch 1's loss is the initial model's.
    result, events = run(tmp_path, epochs=1, label_smoothing=0.3)
    assert of_type(events, "epoch")[0]["train_loss"] == pytest.approx(smoothed, rel=1e-6)
    assert smoothed != pytest.approx(plain, rel=1e-3)
    # Validation loss stays plain cross-entropy (comparable between jobs with and without smoothing).
    assert result["val_loss"] == pytest.approx(infer.evaluate(
        artifacts.load_model(tmp_path / "run" / "artifact", torch.device("cpu"))[0],
        r.data.x_val, r.data.y_val, 1024, torch.device("cpu"))[0], rel=1e-6)


def test_eval_every_validates_on_its_epochs_and_the_last(tmp_path):
    _, events = run(tmp_path, epochs=7, eval_every=3)
    epochs = of_type(events, "epoch")
    assert [e["epoch"] for e in epochs if "val_loss" in e] == [3, 6, 7]
    assert all("val_accuracy" not in e for e in epochs if e["epoch"] not in (3, 6, 7))


@pytest.mark.parametrize("eval_every, stops_at", [(1, 3), (2, 6)])
def test_early_stopping_stops_after_patience_evaluations_without_improvement(tmp_path, eval_every, stops_at):
    # No epoch can improve val_accuracy by more than 1.0: the first evaluation sets the bar.
    result, events = run(tmp_path, epochs=50, eval_every=eval_every,
                         early_stopping={"metric": "val_accuracy", "patience": 2, "min_delta": 1.0})
    assert result["stopped_early_at"] == stops_at
    assert [e["epoch"] for e in of_type(events, "epoch")] == list(range(1, stops_at + 1))
    assert of_type(events, "total") == [{"type": "total", "epochs": stops_at}]
    assert any("early stopping at epoch" in e["line"] for e in of_type(events, "log"))
    assert result["kept_epoch"] == stops_at


def test_early_stopping_waits_while_the_metric_improves(tmp_path):
    # Iris's loss falls for all of its first 30 epochs at this lr: nothing to stop.
    result, events = run(tmp_path, epochs=30, early_stopping={"metric": "val_loss", "patience": 1})
    assert result["stopped_early_at"] is None and len(of_type(events, "epoch")) == 30


def test_keep_best_saves_the_best_evaluated_epoch(tmp_path):
    # Too high a learning rate: the validation loss bottoms out early and then wanders.
    result, events = run(tmp_path, epochs=30, lr=0.3, optimizer="sgd", momentum=0.9, keep="best")
    evaluated = {e["epoch"]: e for e in of_type(events, "epoch")}
    best = min(evaluated, key=lambda e: evaluated[e]["val_loss"])
    assert result["kept"] == "best" and result["kept_epoch"] == best < 30
    assert result["val_loss"] == evaluated[best]["val_loss"] != evaluated[30]["val_loss"]
    model, _ = artifacts.load_model(tmp_path / "run" / "artifact", torch.device("cpu"))
    r = train.build(train_spec(), make_ctx(tmp_path, [], "data"))
    loss, accuracy, _ = infer.evaluate(model, r.data.x_val, r.data.y_val, 1024, torch.device("cpu"))
    assert loss == pytest.approx(evaluated[best]["val_loss"], rel=1e-6)
    assert accuracy == evaluated[best]["val_accuracy"]

    by_accuracy, events = run(tmp_path, "acc", epochs=30, lr=0.3, optimizer="sgd", momentum=0.9, keep="best",
                              keep_metric="val_accuracy")
    accuracies = [e["val_accuracy"] for e in of_type(events, "epoch")]
    assert by_accuracy["kept_epoch"] == accuracies.index(max(accuracies)) + 1


def test_checkpoints_wait_checkpoint_every_s_between_them(tmp_path):
    _, events = run(tmp_path, "hourly", epochs=20, checkpoint_every_s=3600)
    assert not of_type(events, "checkpoint")
    _, events = run(tmp_path, "always", epochs=20, checkpoint_every_s=0, checkpoint_every=5)
    assert [c["epoch"] for c in of_type(events, "checkpoint")] == [5, 10, 15]


# Every option at once, stopped mid-epoch and mid-accumulation-group: the resumed run is the same run
# (digits are 1 x 8 x 8 images: augmentation applies).
OPTIONS = dict(model={"arch": "mlp", "hidden": [16], "dropout": 0.2}, data_={"dataset": "digits"},
               epochs=4, batch_size=64, accumulate_steps=3, grad_clip_norm=0.5, label_smoothing=0.1,
               lr_schedule={"name": "cosine", "warmup_epochs": 1}, keep="best", eval_every=1,
               early_stopping={"metric": "val_loss", "patience": 3}, checkpoint_every_s=3600,
               augment={"crop_padding": 1, "horizontal_flip": True})


@pytest.mark.parametrize("stop_after", [8, 30])  # digits: 23 batches per epoch, so 8 groups of 3
def test_a_run_with_every_option_resumes_exactly(tmp_path, stop_after):
    spec = train_spec(**OPTIONS)
    full_events = []
    full = train.train(spec, make_ctx(tmp_path, full_events, "full"))
    first_events = []
    with pytest.raises(Preempted):
        train.train(spec, make_ctx(tmp_path, first_events, "first", stop_after_steps=stop_after))
    ck = of_type(first_events, "checkpoint")[-1]
    assert ck["step"] % 3 == 0  # stopped between optimizer steps, not within a group
    second_events = []
    resumed = train.train(spec, make_ctx(tmp_path, second_events, "second", resume_path=ck["path"]))
    assert resumed["kept_epoch"] == full["kept_epoch"] and resumed["val_loss"] == full["val_loss"]
    done = of_type(first_events, "epoch") + of_type(second_events, "epoch")
    assert [e["lr"] for e in done] == [e["lr"] for e in of_type(full_events, "epoch")]
    wf, ws = weights(tmp_path / "full" / "artifact"), weights(tmp_path / "second" / "artifact")
    assert all(torch.equal(wf[k], ws[k]) for k in wf)


@pytest.mark.parametrize("train_params, field", [
    ({"lr_schedule": {"name": "exponential"}}, "lr_schedule.name"),
    ({"lr_schedule": {"name": "cosine", "min_lr": -1}}, "lr_schedule.min_lr"),
    ({"lr_schedule": {"name": "step", "gamma": 0}}, "lr_schedule.gamma"),
    ({"grad_clip_norm": 0}, "grad_clip_norm"),
    ({"accumulate_steps": 0}, "accumulate_steps"),
    ({"label_smoothing": 1.0}, "label_smoothing"),
    ({"eval_every": 0}, "eval_every"),
    ({"early_stopping": {"metric": "train_loss"}}, "early_stopping.metric"),
    ({"early_stopping": {"patience": 0}}, "early_stopping.patience"),
    ({"early_stopping": {"patiense": 2}}, "early_stopping.patiense"),
    ({"keep": "first"}, "keep"),
    ({"checkpoint_every_s": -1}, "checkpoint_every_s"),
    ({"deterministic": True, "cudnn_benchmark": True}, "cudnn_benchmark"),
])
def test_bad_options_name_their_field(train_params, field):
    with pytest.raises(ValidationError) as e:
        parse_spec({"kind": "train", "model": {"arch": "mlp"}, "data": {"dataset": "iris"}, "train": train_params})
    assert any(".".join(map(str, err["loc"])).endswith("train." + field) for err in e.value.errors()), e.value


def test_deterministic_turns_on_deterministic_algorithms_and_says_so(tmp_path):
    # cuDNN's autotuner (on by default) is off in a deterministic job without being asked; both asked: 422 above.
    spec = train_spec(deterministic=True, epochs=1)
    assert spec.train.cudnn_benchmark is False and train_spec().train.cudnn_benchmark is True
    try:
        result = train.train(spec, make_ctx(tmp_path, []))
        assert torch.are_deterministic_algorithms_enabled()  # process-wide: the job process's own
    finally:
        torch.use_deterministic_algorithms(False)
    assert result["applied"]["deterministic"] == "on"
    assert train.train(train_spec(epochs=1), make_ctx(tmp_path, [], "plain"))["applied"]["deterministic"] == "off"
    assert not torch.are_deterministic_algorithms_enabled()


def test_stored_spec_keeps_only_the_fields_that_apply():
    spec = train_spec(lr_schedule={"name": "step"}, keep="last").model_dump(mode="json")["train"]
    assert spec["lr_schedule"] == {"name": "step", "warmup_epochs": 0.0, "step_epochs": 30, "gamma": 0.1}
    assert "keep_metric" not in spec
    assert train_spec(keep="best").model_dump(mode="json")["train"]["keep_metric"] == "val_loss"


@pytest.mark.slow  # 8 s: the full suite's, not the quick loop's
def test_through_the_service_an_early_stopped_job_succeeds_with_its_best_epoch(service):
    service.start_worker("cpu")
    body = {**TRAIN_EXAMPLE, "train": {**TRAIN_EXAMPLE["train"], "epochs": 60, "eval_every": 2, "keep": "best",
                                       "lr_schedule": {"name": "cosine", "warmup_epochs": 2},
                                       "early_stopping": {"metric": "val_accuracy", "patience": 3,
                                                          "min_delta": 1.0}}}
    job_id = service.submit(body)["id"]
    done = service.wait_state(job_id)
    assert done["state"] == "succeeded", done
    result = done["result"]
    assert result["stopped_early_at"] == 8 and result["kept"] == "best"
    assert done["progress"]["epoch"] == done["progress"]["epochs"] == 8  # finished, not 8 of 60
    with service.client() as c:
        metrics = c.get(f"/jobs/{job_id}/metrics").json()
        schema = c.get("/catalog").json()["schemas"]["train"]
        logs = c.get(f"/jobs/{job_id}/logs").text
    assert [m["epoch"] for m in metrics if m["val_loss"] is not None] == [2, 4, 6, 8]
    assert metrics[0]["lr"] < metrics[1]["lr"] < metrics[2]["lr"] == pytest.approx(body["train"]["lr"])  # warm-up
    evaluated = [m for m in metrics if m["val_loss"] is not None]
    best = min(evaluated, key=lambda m: m["val_loss"])
    assert result["kept_epoch"] == best["epoch"] and result["val_loss"] == best["val_loss"]
    assert "early stopping at epoch 8" in logs and f"keeping epoch {best['epoch']}" in logs
    train_fields = schema["$defs"]["TrainParams"]["properties"]
    assert {"lr_schedule", "grad_clip_norm", "accumulate_steps", "label_smoothing", "eval_every", "early_stopping",
            "keep", "keep_metric", "checkpoint_every_s"} <= set(train_fields)


def test_augmentation_changes_what_the_loop_trains_on(tmp_path):
    digits = dict(model={"arch": "cnn", "channels": [8]}, data_={"dataset": "digits"}, epochs=2, batch_size=128)
    _, plain = run(tmp_path, "plain", **digits)
    _, augmented = run(tmp_path, "augmented", **digits, augment={"crop_padding": 2})
    _, again = run(tmp_path, "again", **digits, augment={"crop_padding": 2})
    losses = [[e["train_loss"] for e in of_type(events, "epoch")] for events in (plain, augmented, again)]
    assert losses[1] != losses[0] and losses[1] == losses[2]  # seeded: the same job augments the same way


def test_the_readme_example_job_is_valid_and_trains(tmp_path):
    from tests.helpers.service import ROOT
    section = (ROOT / "docs/training.md").read_text().split("## Training options\n", 1)[1].split("\n## ", 1)[0]
    body = json.loads(re.search(r"-d '(\{.*?\})'", section, re.S).group(1))
    spec = parse_spec(body)
    assert spec.train.lr_schedule and spec.train.early_stopping and spec.train.keep == "best"
    body["train"]["epochs"] = 2
    result = train.train(parse_spec(body), make_ctx(tmp_path, []))
    assert result["kept"] == "best" and result["val_accuracy"] > 0.5


def test_small_cpu_steps_run_on_one_thread_and_say_so(tmp_path):
    from trainyard.worker import torch_devices
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)).train()
        x = torch.randn(5, 4)
        before, rng = copy.deepcopy(net.state_dict()), torch.get_rng_state()
        assert torch_devices.step_flops(net, x, 64) == 64 * torch_devices.step_flops(net, x, 1) > 0
        # Counting leaves no trace: no gradients, batch-norm statistics or random draws, still training.
        assert net.training and all(p.grad is None for p in net.parameters())
        assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
        assert torch.equal(rng, torch.get_rng_state())
        applied = {}
        torch_devices.fit_cpu_threads(net, x, 64, torch.device("cpu"), applied)
        assert applied["cpu_threads"] == 1 == torch.get_num_threads()

        torch.set_num_threads(2)
        big = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 10))  # 6 MFLOP a sample
        torch_devices.fit_cpu_threads(big, torch.randn(1, 1024), 64, torch.device("cpu"), applied)
        assert applied["cpu_threads"] == 2 == torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)


def test_a_model_whose_modules_are_versioned_keeps_its_best_epoch_resumes_and_reloads(tmp_path):
    # torchvision's MNASNet refuses a state_dict without its version metadata: the best epoch's copy, the
    # checkpoint and the artifact read back from safetensors all have to carry it.
    spec = train_spec(model={"arch": "mnasnet0_5"}, data_={"dataset": "fake", "image_size": [3, 32, 32], "size": 40},
                      epochs=3, batch_size=16, keep="best", checkpoint_every_s=0)
    first = []
    with pytest.raises(Preempted):
        train.train(spec, make_ctx(tmp_path, first, "first", stop_after_steps=3))
    resumed = train.train(spec, make_ctx(tmp_path, [], "second", resume_path=of_type(first, "checkpoint")[-1]["path"]))
    assert resumed["kept"] == "best" and resumed["resumed_from_epoch"] == 1
    model, _ = artifacts.load_model(tmp_path / "second" / "artifact", torch.device("cpu"))
    assert type(model).__name__ == "MNASNet"


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_the_optimizer_is_fused_where_pytorch_can_and_trains_as_the_per_tensor_one_does(tmp_path, optimizer):
    from trainyard.app.spec import TrainParams
    from trainyard.worker.train_setup import make_optimizer
    p = TrainParams(optimizer=optimizer, lr=0.01, momentum=0.9, weight_decay=0.01)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))

    def trained(fused: bool):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        applied: dict[str, str] = {}
        opt = make_optimizer(p, net, applied)
        if not fused:  # the same optimizer and settings, PyTorch's default per-tensor loop
            opt = type(opt)(net.parameters(), **{k: v for k, v in opt.defaults.items()
                                                  if k in ("lr", "momentum", "weight_decay")})
        for _ in range(50):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        return torch.cat([t.flatten() for t in net.parameters()]), opt, applied

    fused, opt, applied = trained(True)
    per_tensor, plain, _ = trained(False)
    assert applied["optimizer"] == "fused" and opt.defaults["fused"] and not plain.defaults["fused"]
    assert not torch.equal(fused, per_tensor)  # another kernel, another rounding ...
    assert torch.allclose(fused, per_tensor, atol=1e-5)  # ... of the same update

    # No fused kernel for sparse gradients: the per-tensor optimizer, which takes them.
    emb = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    applied = {}
    opt = make_optimizer(TrainParams(optimizer="sgd", lr=0.1), emb, applied)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert applied["optimizer"] == "per-tensor" and not opt.defaults["fused"]


def test_a_checkpoint_from_the_per_tensor_optimizer_resumes_on_the_fused_one(tmp_path):
    from trainyard.worker.train_checkpoint import resume
    spec = train_spec(epochs=3, checkpoint_every=1)  # Iris, Adam
    first = []
    with pytest.raises(Preempted):
        train.train(spec, make_ctx(tmp_path, first, "first", stop_after_steps=1))
    path = of_type(first, "checkpoint")[-1]["path"]
    # As a checkpoint written before the service's optimizer was fused (or by a run that could not fuse) has it.
    ck = torch.load(path, weights_only=True)
    assert all(g["fused"] for g in ck["optimizer"]["param_groups"])
    for group in ck["optimizer"]["param_groups"]:
        group["fused"] = None
    torch.save(ck, path)

    ctx = make_ctx(tmp_path, [], "resumed", resume_path=Path(path))
    run = train.build(spec, ctx)
    assert resume(run, ctx).resumed
    assert run.applied["optimizer"] == "fused" and all(g["fused"] for g in run.optimizer.param_groups)
    # And a whole run from it: the fused kernel takes the loaded state (its step counters included).
    result = train.train(spec, make_ctx(tmp_path, [], "again", resume_path=Path(path)))
    assert result["applied"]["optimizer"] == "fused" and result["resumed_from_epoch"] is not None
