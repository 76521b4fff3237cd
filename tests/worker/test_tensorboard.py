"""A job process's TensorBoard event files (worker/event_files.py), written by the real runner in this process and
read back with TensorBoard's own reader: a scalar per epoch per metric, the learning rate, the hyperparameters
through the HParams plugin and the final metrics; a run job's ctx.report; a bucket store; a failure to write
that the job survives; a resumed run's epochs shown once. The live service's side (the archive, sweeps, a resume
after SIGKILL, retention and the CLI) is tests/api/test_tensorboard_api.py's."""
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.helpers.jobs import tiny_job
from tests.helpers.runner import run_in_process
from tests.helpers.service import probe_plugin, run_job
from trainyard.worker.event_files import EventFiles

RUN_PLUGIN = '''
def reports(ctx, config):
    for epoch in range(1, config["epochs"] + 1):
        ctx.report(epoch, loss=1.0 / epoch, accuracy=epoch / 10)
    return {"accuracy": 0.9, "note": "done"}
'''


def read_events(folder: Path) -> EventAccumulator:
    """Every run's event files of one job's folder, as TensorBoard reads them (earlier runs' purged epochs dropped)."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(s.step, s.value) for s in acc.Scalars(tag)]


def close(stored: float, reported: float) -> bool:
    """A scalar as TensorBoard stores it (float32) against the number reported."""
    return abs(stored - reported) <= 1e-6 * max(1.0, abs(reported))


def hparams_of(acc: EventAccumulator) -> dict:
    """The hyperparameters of the HParams plugin's session start, as the plugin reads them."""
    content = acc.SummaryMetadata(hparams_metadata.SESSION_START_INFO_TAG).plugin_data.content
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


def test_a_train_job_writes_each_epochs_metrics_its_lr_hparams_and_final_metrics(tmp_path):
    spec = tiny_job(epochs=3, lr=0.02)
    final, events = run_in_process(tmp_path, spec)
    assert final["type"] == "done"
    [name] = [p.name for p in (tmp_path / "tensorboard" / "1").iterdir()]
    assert "tfevents" in name and name.endswith(".run-1")  # a file per run, named by its claim
    acc = read_events(tmp_path / "tensorboard" / "1")
    epochs = [e for e in events if e["type"] == "epoch"]
    for metric in ("train_loss", "val_loss", "val_accuracy", "samples_per_s", "lr"):
        got = scalars(acc, metric)
        assert [step for step, _ in got] == [1, 2, 3], metric  # one point per epoch, step = epoch
        assert all(close(v, e[metric]) for e, (_, v) in zip(epochs, got)), (metric, got)
    assert all(close(v, 0.02) for _, v in scalars(acc, "lr"))
    hp = hparams_of(acc)
    assert hp["train.lr"] == 0.02 and hp["train.epochs"] == 3 and hp["model.arch"] == "mlp"
    assert hp["data.dataset"] == "iris" and hp["model.hidden"] == "[8]" and hp["train.deterministic"] == "false"
    assert hparams_metadata.SESSION_END_INFO_TAG in acc.summary_metadata
    result = final["result"]
    for metric in ("train_loss", "val_loss", "val_accuracy"):
        [(step, value)] = scalars(acc, f"final/{metric}")
        assert step == 3 and close(value, result[metric])


def test_a_run_jobs_reports_and_returned_numbers_are_its_scalars(tmp_path, monkeypatch):
    (tmp_path / "plugin").mkdir()
    plugin = probe_plugin(tmp_path / "plugin", "trainyard_tb_probe", RUN_PLUGIN, ("reports",))
    monkeypatch.syspath_prepend(str(plugin))
    final, _ = run_in_process(tmp_path, run_job("reports", epochs=4, width=16, name="probe"))
    assert final["type"] == "done", final
    acc = read_events(tmp_path / "tensorboard" / "1")
    for metric, per_epoch in (("loss", lambda n: 1 / n), ("accuracy", lambda n: n / 10)):
        got = scalars(acc, metric)
        assert [s for s, _ in got] == [1, 2, 3, 4] and all(close(v, per_epoch(s)) for s, v in got), got
    [(step, value)] = scalars(acc, "final/accuracy")  # what it returned
    assert step == 4 and close(value, 0.9)
    assert "final/note" not in acc.Tags()["scalars"]  # only numbers are metrics
    hp = hparams_of(acc)
    assert hp == {"entrypoint": "reports", "config.epochs": 4, "config.width": 16, "config.name": "probe"}


def test_a_predict_job_writes_none(tmp_path):
    assert run_in_process(tmp_path)[0]["type"] == "done"
    spec = {"kind": "predict", "model_job": 1, "inputs": [[5.1, 3.5, 1.4, 0.2]], "device": "cpu"}
    (tmp_path / "p").mkdir()
    final, _ = run_in_process(tmp_path / "p", spec, model_dir=tmp_path / "art", model_spec=tiny_job())
    assert final["type"] == "done", final
    assert not (tmp_path / "p" / "tensorboard").exists()


def test_event_files_reach_a_bucket_store(tmp_path, bucket):
    final, _ = run_in_process(tmp_path, tiny_job(epochs=2), storage_url=bucket.url)
    assert final["type"] == "done"
    local = sorted(p.name for p in (tmp_path / "tensorboard" / "1").iterdir())
    assert [k.rpartition("/")[2] for k in bucket.keys() if "/tensorboard/1/" in k] == local
    [key] = [k for k in bucket.keys() if "/tensorboard/1/" in k]
    stored = bucket.client().get_object(Bucket=bucket.name, Key=key)["Body"].read()
    assert stored == (tmp_path / "tensorboard" / "1" / local[0]).read_bytes()  # the whole file, as closed


def test_a_failure_to_write_is_logged_and_the_job_goes_on(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the folder of every job's event files should be")
    final, events = run_in_process(tmp_path, tiny_job(epochs=3))
    assert final["type"] == "done" and final["result"]["epochs"] == 3
    said = [e["line"] for e in events if e["type"] == "log" and e["line"].startswith("tensorboard:")]
    assert len(said) == 1 and "the job goes on" in said[0], said  # said once, not once an epoch
    assert [e["epoch"] for e in events if e["type"] == "epoch"] == [1, 2, 3]


def test_a_resumed_run_hides_what_the_crash_lost_even_its_last_epoch(tmp_path):
    """The first run reported epochs 1-3 and died after its checkpoint at 2; the second reports 3 and 4 again. An
    epoch reported again at the step the first run reached is no step back, which TensorBoard would notice on its
    own: only the second run's purge_step keeps it from showing twice."""
    folder, said = tmp_path / "tensorboard" / "7", []
    first = EventFiles(folder, None, {"train.lr": 0.1}, said.append, "train", claim=1)
    for epoch in (1, 2, 3):
        first({"type": "epoch", "epoch": epoch, "train_loss": 10.0 + epoch})
    first({"type": "checkpoint", "epoch": 2, "step": 0, "path": "ck"})  # as a SIGKILL leaves it: never closed
    time.sleep(1.1)  # a later second in the file's name, as a run resumed after a lost lease always is
    second = EventFiles(folder, None, {"train.lr": 0.1}, said.append, "train", claim=2)
    for epoch in (3, 4):
        second({"type": "epoch", "epoch": epoch, "train_loss": 20.0 + epoch})
    second({"type": "done", "result": {"train_loss": 24.0, "val_loss": 1.0, "val_accuracy": 0.5}})
    acc = read_events(folder)
    assert scalars(acc, "train_loss") == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
    assert [e["type"] for e in said] == ["epoch"] * 3 + ["checkpoint"] + ["epoch"] * 2 + ["done"]  # passed on
