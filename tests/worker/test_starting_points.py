"""Starting points (worker/starting.py): init_from another job's model, torchvision's published weights,
the classifier head re-made when the classes differ, and the checks at submit."""
import re
from functools import partial
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torchvision
from pydantic import ValidationError

from tests.helpers.jobs import tiny_job
from tests.helpers.service import ROOT, serving
from trainyard.app.spec import ALL_ARCHS, ModelSpec, catalog, parse_spec
from trainyard.worker import nets, starting, train
from trainyard.worker.errors import JobError, Preempted
from trainyard.worker.job_context import JobContext

# The head of each built-in architecture, as the README's table names it.
HEADS = {"mlp": "out", "cnn": "11", "cifar_net": "fc3", "alexnet": "classifier.6", "convnext_tiny": "classifier.2",
         "convnext_small": "classifier.2", "densenet121": "classifier", "densenet161": "classifier",
         "densenet169": "classifier", "efficientnet_b0": "classifier.1", "efficientnet_b1": "classifier.1",
         "efficientnet_v2_s": "classifier.1", "googlenet": "fc", "mnasnet0_5": "classifier.1",
         "mnasnet1_0": "classifier.1", "mobilenet_v2": "classifier.1", "mobilenet_v3_large": "classifier.3",
         "mobilenet_v3_small": "classifier.3", "regnet_x_400mf": "fc", "regnet_y_400mf": "fc", "resnet18": "fc",
         "resnet34": "fc", "resnet50": "fc", "resnet101": "fc", "resnext50_32x4d": "fc", "shufflenet_v2_x0_5": "fc",
         "shufflenet_v2_x1_0": "fc", "squeezenet1_0": "classifier.1", "squeezenet1_1": "classifier.1",
         "swin_t": "head", "vgg11": "classifier.6", "vgg11_bn": "classifier.6", "vgg16": "classifier.6",
         "vit_b_16": "heads.head", "wide_resnet50_2": "fc"}
FAKE = {"dataset": "fake", "image_size": [3, 32, 32], "num_classes": 4, "size": 40}
RESNET_FILE = "resnet18-f37072fd.pth"  # what ResNet18_Weights.DEFAULT's URL names
# A proxy nobody listens on: the worker's download fails at once, online or not.
OFFLINE = {"https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}


def make_ctx(root: Path, name: str, init_dir=None, resume_path=None, stop_after_steps=None,
             events=None) -> JobContext:
    steps = [0]

    def stop_requested():
        steps[0] += 1
        return stop_after_steps is not None and steps[0] > stop_after_steps
    return JobContext(job_id=1, device=torch.device("cpu"), data_dir=root / "data",
                      artifact_dir=root / name / "artifact",
                      checkpoint_path=root / name / "checkpoint.pt", init_dir=init_dir, resume_path=resume_path,
                      stop_requested=stop_requested, emit=(events if events is not None else []).append)


def weights(artifact_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(artifact_dir / "model.safetensors")


def fresh(spec, input_shape, classes: int) -> dict[str, torch.Tensor]:
    """The weights a job's seed draws for its model (train.build seeds right before building it)."""
    torch.manual_seed(spec.train.seed)
    return nets.build_model(spec.model, input_shape, classes).state_dict()


# -- the spec ----------------------------------------------------------------------------------------

def test_spec_fields():
    resnet = parse_spec({"kind": "train", "model": {"arch": "resnet18", "weights": "IMAGENET1K_V1"}, "data": FAKE})
    assert resnet.model_dump(mode="json")["model"] == {"arch": "resnet18", "num_classes": None,
                                                        "weights": "IMAGENET1K_V1"}
    assert "weights" not in parse_spec(tiny_job()).model_dump(mode="json")["model"]  # torchvision archs only
    assert parse_spec({**tiny_job(), "init_from": 3}).init_from == 3
    refused = [({"model": {"arch": "mlp", "weights": "DEFAULT"}}, "weights"),
               ({"model": {"arch": "resnet18", "weights": "default"}}, "weights"),
               ({"model": {"arch": "resnet18", "weights": "../../etc"}}, "weights"),
               ({"model": {"arch": "resnet18", "weights": "DEFAULT"}, "init_from": 1}, "init_from"),
               ({"init_from": 0}, "init_from"), ({"init_from": 2**60}, "init_from"), ({"init_from": "1"}, "init_from")]
    for patch, field in refused:
        with pytest.raises(ValidationError, match=field):
            parse_spec({**tiny_job(), "data": FAKE, **patch})
    archs = {a["name"]: a["params"] for a in catalog()["architectures"]}
    assert "weights" in archs["resnet18"] and "weights" not in archs["mlp"]


# -- the head ----------------------------------------------------------------------------------------

def test_the_head_of_every_builtin_arch_is_the_readmes():
    readme = (ROOT / "docs/training.md").read_text().split("## Fine-tuning and pretrained weights", 1)[1]
    assert set(HEADS) == set(ALL_ARCHS)
    for arch in ALL_ARCHS:
        spec = ModelSpec(arch=arch)
        shape = {"mlp": (4,), "cifar_net": (3, 32, 32)}.get(arch, (3, 224, 224))
        assert starting.head(spec, shape, 10) == {f"{HEADS[arch]}.weight", f"{HEADS[arch]}.bias"}, arch
        assert f"`{HEADS[arch]}`" in readme, arch


def test_only_the_head_is_remade_and_it_is_the_seeds_fresh_init(tmp_path):
    """A 4-class model into a 6-class job: every other layer loaded, the head as its seed draws it."""
    source = nets.build_model(ModelSpec(arch="cnn", channels=[4, 8]), (3, 16, 16), 4)
    spec = parse_spec({"kind": "train", "model": {"arch": "cnn", "channels": [4, 8]}, "train": {"seed": 7},
                       "data": {**FAKE, "image_size": [3, 16, 16], "num_classes": 6}})
    drawn = fresh(spec, (3, 16, 16), 6)
    torch.manual_seed(spec.train.seed)
    model = nets.build_model(spec.model, (3, 16, 16), 6)
    remade = starting.load(model, source.state_dict(), "job 1", lambda: starting.head(spec.model, (3, 16, 16), 6))
    assert remade == {"11": (4, 6)}
    got = model.state_dict()
    for key, value in source.state_dict().items():
        assert torch.equal(got[key], drawn[key] if key.startswith("11.") else value), key


def test_a_shape_that_is_not_the_heads_fails_naming_the_layer():
    source = nets.build_model(ModelSpec(arch="mlp", hidden=[8]), (4,), 3).state_dict()
    spec = ModelSpec(arch="mlp", hidden=[9])
    model = nets.build_model(spec, (4,), 5)
    with pytest.raises(JobError, match=r"fc1.weight is \[8, 4\] there and \[9, 4\] here"):
        starting.load(model, source, "job 1", lambda: starting.head(spec, (4,), 5))
    with pytest.raises(JobError, match="lacks out.weight"):
        starting.load(model, {k: v for k, v in source.items() if k != "out.weight"}, "job 1", set)


# -- init_from ---------------------------------------------------------------------------------------

def test_init_from_starts_from_the_model_and_a_resumed_job_from_its_checkpoint(tmp_path):
    a = parse_spec({**tiny_job(epochs=20, lr=0.01)})
    first = train.train(a, make_ctx(tmp_path, "a"))
    a_dir = tmp_path / "a" / "artifact"

    # A learning rate too small to move a weight: B ends where A's model was, with A's accuracy.
    b = parse_spec({**tiny_job(epochs=1, lr=1e-12, seed=5), "init_from": 1})
    ctx = make_ctx(tmp_path, "b", init_dir=a_dir)
    result = train.train(b, ctx)
    assert ctx.started_from == {"init_from": 1, "remade": []}
    assert result["val_accuracy"] == first["val_accuracy"]
    for key, value in weights(a_dir).items():
        assert torch.allclose(weights(tmp_path / "b" / "artifact")[key], value, atol=1e-9), key

    # Stopped mid-run and resumed: the checkpoint's weights, not A's, so it ends as a run never stopped.
    c = parse_spec({**tiny_job(epochs=3, lr=0.01, seed=5), "init_from": 1})
    train.train(c, make_ctx(tmp_path, "full", init_dir=a_dir))
    events = []
    with pytest.raises(Preempted):
        train.train(c, make_ctx(tmp_path, "stopped", init_dir=a_dir, stop_after_steps=7, events=events))
    checkpoint = Path([e for e in events if e["type"] == "checkpoint"][-1]["path"])
    resumed = train.train(c, make_ctx(tmp_path, "resumed", init_dir=a_dir, resume_path=checkpoint))
    assert resumed["resumed_from_epoch"] == 1
    want, got = weights(tmp_path / "full" / "artifact"), weights(tmp_path / "resumed" / "artifact")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert not all(torch.equal(want[k], weights(a_dir)[k]) for k in want)


def test_init_from_checks_in_the_worker(tmp_path):
    train.train(parse_spec(tiny_job(epochs=1)), make_ctx(tmp_path, "a"))
    a_dir = tmp_path / "a" / "artifact"
    digits = parse_spec({**tiny_job(epochs=1), "data": {"dataset": "digits"}, "init_from": 1})
    with pytest.raises(JobError,
                       match=r"init_from: job 1's model takes inputs of shape \(4,\); digits has \(1, 8, 8\)"):
        train.train(digits, make_ctx(tmp_path, "b", init_dir=a_dir))
    cnn = parse_spec({**tiny_job(epochs=1), "model": {"arch": "cnn"}, "data": {"dataset": "digits"}, "init_from": 1})
    with pytest.raises(JobError, match="init_from: job 1 trained a mlp; this job's model is a cnn"):
        train.train(cnn, make_ctx(tmp_path, "c", init_dir=a_dir))
    with pytest.raises(JobError, match="artifact of job 1 is gone"):
        train.train(parse_spec({**tiny_job(epochs=1), "init_from": 1}),
                    make_ctx(tmp_path, "d", init_dir=tmp_path / "x"))


# -- published weights -------------------------------------------------------------------------------

def test_published_files_are_read_as_torchvision_reads_them(tmp_path, monkeypatch):
    """DenseNet's files keep the old `norm.1` names and googlenet's hold its auxiliary classifiers:
    both load into trainyard's models, every layer but the head."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for arch, published in (("densenet121", torchvision.models.densenet121()),
                            ("googlenet", torchvision.models.googlenet(aux_logits=True, init_weights=False))):
        state = published.state_dict()
        # Files from before batch norm counted its steps: no num_batches_tracked.
        old = {re.sub(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.(weight|bias|running_)", r"\1.\2.\3", k): v
               for k, v in state.items() if not k.endswith("num_batches_tracked")}
        path = starting.weights_file(torchvision.models.get_model_weights(arch).DEFAULT.url)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(old, path)
        assert any(".norm.1." in k or k.startswith("aux1.") for k in old)  # what torchvision's loaders adjust
        spec = ModelSpec(arch=arch, weights="DEFAULT")
        model = nets.build_model(spec, (3, 32, 32), 10)
        loaded, _, file = starting.published(arch, "DEFAULT")
        assert file == path
        remade = starting.load(model, loaded, arch, partial(starting.head, spec, (3, 32, 32), 10))
        assert set(remade) == {HEADS[arch]}
        for key, value in model.state_dict().items():
            if not key.startswith(HEADS[arch] + "."):
                assert torch.equal(value, state[key]), key


def test_unknown_weights_name_lists_the_arch_s():
    with pytest.raises(JobError, match="resnet18 has no weights 'IMAGENET1K_V9'; valid: DEFAULT, IMAGENET1K_V1"):
        starting.published("resnet18", "IMAGENET1K_V9")


# -- through the service ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_home(tmp_path_factory):
    return tmp_path_factory.mktemp("torch-home")


@pytest.fixture(scope="module")
def live(tmp_path_factory, torch_home):
    """One service for the module: a server and a worker whose torch.hub cache is torch_home."""
    with serving(tmp_path_factory.mktemp("starting") / "data",
                 worker_env={"TORCH_HOME": str(torch_home), **OFFLINE}) as svc:
        yield svc


def artifact(live, job: dict) -> dict[str, torch.Tensor]:
    with live.client() as c:
        return safetensors.torch.load(c.get(f"/jobs/{job['id']}/artifact").content)


@pytest.mark.slow
def test_init_from_through_the_service(live):
    a = live.wait_state(live.submit({**tiny_job(epochs=20, lr=0.01), "model": {"arch": "mlp", "hidden": [8]}})["id"])
    assert a["state"] == "succeeded"
    # Fine-tuned with a learning rate too small to move a weight: it ends where A's model is.
    b = live.wait_state(live.submit({**tiny_job(epochs=1, lr=1e-12), "model": {"arch": "mlp", "hidden": [8]},
                                     "init_from": a["id"]})["id"])
    assert b["state"] == "succeeded", b["error"]
    assert b["result"]["val_accuracy"] == a["result"]["val_accuracy"]
    got, want = artifact(live, b), artifact(live, a)
    assert all(torch.allclose(got[k], want[k], atol=1e-9) for k in want)
    with live.client() as c:
        logs = c.get(f"/jobs/{b['id']}/logs").text
        assert f"started from init_from job {a['id']}'s model: every layer loaded" in logs

    # Another number of classes: the head is re-made, the rest is the 4-class model's.
    mlp = {"arch": "mlp", "hidden": [16]}
    four = live.wait_state(live.submit({**tiny_job(epochs=2), "model": mlp,
                                        "data": {**FAKE, "image_size": [1, 8, 8]}})["id"])
    six = live.wait_state(live.submit({**tiny_job(epochs=1, lr=1e-12, seed=3), "model": mlp, "init_from": four["id"],
                                       "data": {**FAKE, "image_size": [1, 8, 8], "num_classes": 6}})["id"])
    assert six["state"] == "succeeded", six["error"]
    got, want = artifact(live, six), artifact(live, four)
    assert got["out.weight"].shape == (6, 16) and torch.allclose(got["fc1.weight"], want["fc1.weight"], atol=1e-9)
    drawn = fresh(parse_spec({**tiny_job(seed=3), "model": mlp}), (1, 8, 8), 6)
    assert torch.allclose(got["out.weight"], drawn["out.weight"], atol=1e-9)
    with live.client() as c:
        assert "out re-made for 6 outputs (was 4), fresh from seed 3" in c.get(f"/jobs/{six['id']}/logs").text

        # Refused at submit, naming init_from.
        failed = live.wait_state(live.submit({**tiny_job(), "model": {"arch": "mlp", "num_classes": 2}})["id"])
        assert failed["state"] == "failed"
        for patch, says in [({"init_from": 99999}, "does not exist"), ({"init_from": failed["id"]}, "failed"),
                            ({"init_from": a["id"], "model": {"arch": "cnn"}, "data": {"dataset": "digits"}},
                             "is a mlp model; this job's model is a cnn"),
                            ({"init_from": a["id"], "model": {"arch": "mlp", "hidden": [9]}}, "has hidden [8]"),
                            ({"init_from": a["id"], "model": {"arch": "mlp", "hidden": [8]},
                              "data": {"dataset": "digits"}}, "inputs of shape [4]; digits has [1, 8, 8]")]:
            r = c.post("/jobs", json={**tiny_job(), **patch})
            assert r.status_code == 422 and "init_from" in r.text and says in r.text, (patch, r.text)


@pytest.mark.slow
def test_pretrained_weights_through_the_service(live, torch_home):
    job = {"kind": "train", "model": {"arch": "resnet18", "weights": "DEFAULT"}, "data": FAKE, "device": "cpu",
           "train": {"epochs": 1, "batch_size": 32, "lr": 1e-12}}
    path = torch_home / "hub" / "checkpoints" / RESNET_FILE
    # Not in the cache, and the worker cannot download it: a job error saying what to put where.
    missing = live.wait_state(live.submit(job)["id"])
    assert missing["state"] == "failed" and missing["error"]["class"] == "job"
    assert str(path) in missing["error"]["message"] and "download.pytorch.org" in missing["error"]["message"]

    torch.manual_seed(1234)
    published = torchvision.models.resnet18().state_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(published, path)
    done = live.wait_state(live.submit(job)["id"])
    assert done["state"] == "succeeded", done["error"]
    got = artifact(live, done)
    assert got["fc.weight"].shape == (4, 512)
    params = dict(torchvision.models.resnet18().named_parameters())
    for key in params:  # the parameters; batch norm's running statistics moved with the epoch's batches
        if not key.startswith("fc."):
            assert torch.allclose(got[key], published[key], atol=1e-9), key
