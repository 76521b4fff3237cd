"""worker/artifacts.py: artifacts load into fresh models, writes are atomic, loads never unpickle objects."""
import json
import pickle

import pytest
import safetensors.torch
import torch

from trainyard.app.spec import TRAIN_EXAMPLE, ModelSpec, parse_spec
from trainyard.worker import artifacts, nets


def _meta(spec):
    return {"spec": spec.model_dump(mode="json"), "input_shape": [1, 8, 8], "num_classes": 10,
            "class_names": [str(i) for i in range(10)]}


@pytest.fixture
def cnn():
    spec = parse_spec({"kind": "train", "model": {"arch": "cnn", "channels": [4, 8]}, "data": {"dataset": "digits"}})
    torch.manual_seed(0)
    model = nets.build_model(spec.model, (1, 8, 8), 10)
    model.train()(torch.randn(16, 1, 8, 8))  # move the batch-norm running stats off their defaults
    return spec, model.eval()


def test_artifact_loads_into_a_fresh_model(tmp_path, cnn):
    spec, model = cnn
    artifacts.save_artifact(tmp_path, model, _meta(spec))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "model.pt", "model.safetensors"]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["format"] == 1 and meta["input_shape"] == [1, 8, 8] and meta["spec"]["model"]["arch"] == "cnn"

    want = model.state_dict()
    for state in (torch.load(tmp_path / "model.pt", weights_only=True),
                  safetensors.torch.load_file(tmp_path / "model.safetensors")):
        fresh = nets.build_model(spec.model, (1, 8, 8), 10)
        fresh.load_state_dict(state)  # strict
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, want[key]), key

    loaded, loaded_meta = artifacts.load_model(tmp_path, torch.device("cpu"))
    assert not loaded.training and loaded_meta["class_names"] == meta["class_names"]
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_compiled_model_is_saved_with_clean_keys(tmp_path, cnn):
    spec, model = cnn
    compiled = torch.compile(model)  # lazy: nothing compiles unless it is called
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    artifacts.save_artifact(tmp_path, compiled, _meta(spec))
    assert set(safetensors.torch.load_file(tmp_path / "model.safetensors")) == set(model.state_dict())


def test_failed_write_keeps_the_old_file_and_leaves_no_temp_files(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    artifacts.save_checkpoint(path, {"epoch": 1})

    def broken_save(obj, f, *a, **kw):
        open(f, "wb").write(b"half a checkpo")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        artifacts.save_checkpoint(path, {"epoch": 2})
    monkeypatch.undo()
    assert artifacts.load_checkpoint(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


class Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_load_checkpoint_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": Exploit()}, path)
    with pytest.raises(pickle.UnpicklingError):
        artifacts.load_checkpoint(path)


def test_checkpoint_round_trip_with_adam_state(tmp_path):
    model = nets.build_model(ModelSpec(arch="mlp", hidden=[8]), (4,), 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(6, 4)), torch.tensor([0, 1, 2, 0, 1, 2])).backward()
        optimizer.step()
    path = tmp_path / "ck.pt"
    artifacts.save_checkpoint(path, {"epoch": 3, "step": 0, "model": model.state_dict(),
                                     "optimizer": optimizer.state_dict(), "partial": None})
    ck = artifacts.load_checkpoint(path)
    fresh = nets.build_model(ModelSpec(arch="mlp", hidden=[8]), (4,), 3)
    fresh.load_state_dict(ck["model"])
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_opt.load_state_dict(ck["optimizer"])
    artifacts.optimizer_to(fresh_opt, torch.device("cpu"))
    for p, q in zip(model.parameters(), fresh.parameters()):
        a, b = optimizer.state[p], fresh_opt.state[q]
        assert torch.equal(a["step"], b["step"]) and b["step"].device.type == "cpu"
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def _adam_after_one_step():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return optimizer


def test_optimizer_to_moves_state_but_not_step_counters():
    # The meta device stands in for a GPU: tensors move, no memory or CUDA needed.
    optimizer = _adam_after_one_step()
    artifacts.optimizer_to(optimizer, torch.device("meta"))
    for state in optimizer.state.values():
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"  # PyTorch keeps it a CPU scalar unless capturable/fused


def test_optimizer_to_moves_step_when_capturable():
    optimizer = _adam_after_one_step()
    optimizer.param_groups[0]["capturable"] = True
    artifacts.optimizer_to(optimizer, torch.device("meta"))
    assert all(state["step"].device.type == "meta" for state in optimizer.state.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_optimizer_to_cuda_and_back():
    optimizer = _adam_after_one_step()
    artifacts.optimizer_to(optimizer, torch.device("cuda"))
    assert all(s["exp_avg"].is_cuda and not s["step"].is_cuda for s in optimizer.state.values())
    artifacts.optimizer_to(optimizer, torch.device("cpu"))
    assert all(not s["exp_avg"].is_cuda for s in optimizer.state.values())


def test_load_model_rebuilds_from_meta_only(tmp_path):
    spec = parse_spec(TRAIN_EXAMPLE)
    torch.manual_seed(1)
    model = nets.build_model(spec.model, (4,), 3)
    artifacts.save_artifact(tmp_path, model, {"spec": spec.model_dump(mode="json"), "input_shape": [4],
                                              "num_classes": 3, "class_names": ["a", "b", "c"]})
    torch.manual_seed(2)  # a different init: the weights must come from the file
    loaded, _ = artifacts.load_model(tmp_path, torch.device("cpu"))
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(p, q)
