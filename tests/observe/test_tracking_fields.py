"""What an MLflow run holds of a job, from its row (app/tracking/fields.py), and the spec's tracking fields: the
spec flattened within MLflow's limits, a point per epoch per number with the record's own timestamp, the status of
each end, the tags, the experiment's name; hostile values in the spec refused naming the field."""
import pytest
from pydantic import ValidationError

from tests.helpers.jobs import tiny_job
from trainyard.app.core.states import JobState
from trainyard.app.spec import parse_spec
from trainyard.app.tracking import fields


def test_a_spec_flattens_to_parameters_within_mlflows_limits():
    spec = {"kind": "train", "model": {"arch": "mlp", "hidden": [8, 4]}, "train": {"lr": 0.02, "augment": None},
            "name": "x", "long": "v" * 7000, "odd key!": 1}
    got = fields.flatten(spec)
    assert got["model.arch"] == "mlp" and got["model.hidden"] == "[8,4]" and got["train.lr"] == "0.02"
    assert "train.augment" not in got  # None: left out
    assert len(got["long"]) == fields.MAX_PARAM_VALUE and got["long"].endswith("...")
    assert got["odd key_"] == "1"  # a character MLflow refuses in a key becomes "_"
    assert fields.flatten(None) == {} and fields.flatten(3) == {}


def test_points_are_one_per_epoch_and_number_with_the_records_timestamp():
    epochs = [(1, {"epoch": 1, "val_loss": 0.5, "ok": True, "note": "x", "nan": float("nan"), "n": 3}, 10.5),
              (2, {"val_loss": 0.25, "inf": float("inf")}, 11.0)]
    assert list(fields.points(epochs)) == [("val_loss", 0.5, 10500, 1), ("n", 3.0, 10500, 1),
                                           ("val_loss", 0.25, 11000, 2)]
    assert list(fields.points(epochs)) == list(fields.points(epochs))  # sent twice, the same points
    assert fields.finals({"val_accuracy": 0.9, "class_names": ["a"], "kept": True}) == {"final/val_accuracy": 0.9}


def test_each_end_has_its_mlflow_status_and_a_pruned_trial_its_tag():
    assert {s: fields.STATUS[s] for s in fields.STATUS} == {
        JobState.SUCCEEDED: "FINISHED", JobState.FAILED: "FAILED", JobState.CANCELLED: "KILLED",
        JobState.PRUNED: "KILLED"}
    row = {"id": 7, "kind": "train", "state": "pruned", "spec": {"tracking": {"git_commit": "abc1234"}},
           "name": None, "attempt": 1, "claim": 1, "owner": "ann", "worker_id": "w1", "device": "cpu",
           "sweep": {"id": 3, "trial": 2}, "error": {"class": "pruned", "message": "pruned at epoch 4"}}
    tags = fields.job_tags(row, "http://ty:8000/", "alpha")
    assert tags["trainyard.pruned"] == "true" and tags["trainyard.error_class"] == "pruned"
    assert tags["mlflow.runName"] == "job-7" and tags["trainyard.url"] == "http://ty:8000/#/jobs/7"
    assert tags["mlflow.user"] == "ann" and tags["trainyard.project"] == "alpha"
    assert tags["mlflow.source.git.commit"] == "abc1234" and tags["trainyard.sweep_id"] == "3"
    assert fields.job_tags({**row, "kind": "predict", "state": "succeeded"}, "u", None)["trainyard.kind"] == "evaluate"


def test_the_experiment_is_the_specs_else_the_services_template():
    assert fields.experiment_name("trainyard-{project}", {}, None) == "trainyard-default"
    assert fields.experiment_name("trainyard-{project}", {}, "alpha") == "trainyard-alpha"
    assert fields.experiment_name("t", {"tracking": {"experiment": "mine"}}, "alpha") == "mine"
    assert fields.run_url("http://m:5000/", "1", "abc") == "http://m:5000/#/experiments/1/runs/abc"
    assert fields.run_url("databricks", "1", "abc") is None and fields.run_url("http://m", "1", None) is None


@pytest.mark.parametrize("tracking, field", [
    ({"register_model": "it's"}, "register_model"),  # a quote would end the registry's filter string
    ({"register_model": "a" * 101}, "register_model"),
    ({"git_commit": "main; rm -rf /"}, "git_commit"),
    ({"experiment": "bad\x00name"}, "experiment"),
    ({"experiment": ""}, "experiment"),
    ({"mlflow": "yes please"}, "mlflow"),
    ({"password": "x"}, "password"),  # credentials are the service's settings, never a spec's
])
def test_hostile_tracking_values_are_refused_naming_the_field(tracking, field):
    with pytest.raises(ValidationError) as err:
        parse_spec({**tiny_job(), "tracking": tracking})
    assert any(e["loc"][-1] == field or field in str(e["loc"]) for e in err.value.errors()), err.value.errors()


def test_a_predict_job_has_no_model_to_register():
    with pytest.raises(ValidationError, match="tracking.register_model"):
        parse_spec({"kind": "predict", "model_job": 1, "inputs": [[1.0]], "tracking": {"register_model": "m"}})


def test_the_trackers_credentials_never_reach_a_record_or_an_error():
    """A tracking URI may carry its credentials (http://user:password@host): a job's record shows the run's page
    without them, and an error that quotes them, or the password or token settings, keeps *** in their place."""
    from pydantic import SecretStr

    from trainyard.app.core.settings import Settings
    from trainyard.app.tracking.mlflow_calls import credentials
    uri = "https://ty:s3cret@mlflow.internal:5000/"
    assert fields.public_uri(uri) == "https://mlflow.internal:5000/"
    assert fields.public_uri("http://m:5000") == "http://m:5000"
    assert fields.run_url(uri, "1", "abc") == "https://mlflow.internal:5000/#/experiments/1/runs/abc"
    settings = Settings(mlflow_tracking_uri=uri, mlflow_password=SecretStr("pw-1"), mlflow_token=SecretStr("tok-2"))
    said = fields.redact(f"ConnectionError: {uri}api/2.0 (auth pw-1, token tok-2)", credentials(settings))
    assert "s3cret" not in said and "pw-1" not in said and "tok-2" not in said
    assert said == "ConnectionError: https://***@mlflow.internal:5000/api/2.0 (auth ***, token ***)"
    assert credentials(Settings(mlflow_tracking_uri="http://m:5000")) == []
