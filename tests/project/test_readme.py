"""The README's curl walk-through and docs/plugins.md's examples, run as written against a live server and worker."""
import json
import re

import pytest

from tests.helpers.docs import run_block
from tests.helpers.service import ROOT

pytestmark = pytest.mark.slow  # starts the real server and workers


def blocks(heading: str, page: str = "README.md") -> list[tuple[str, str]]:
    """The sh and python blocks of one section of the README or a docs page (a page's title: up to its first ##)."""
    text = (ROOT / page).read_text()
    section = text.split(f"# {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(sh|python)\n(.*?)```", section, re.S)


def documents(text: str) -> list:
    """The JSON documents curl printed back to back."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        doc, end = decoder.raw_decode(text, at)
        out.append(doc)
        at = end + len(text[end:]) - len(text[end:].lstrip())
    return out


def walkthrough_blocks() -> list[tuple[str, str]]:
    return blocks("Walk-through with curl")


def test_readme_walkthrough(service, tmp_path):
    service.start_worker("cpu")
    host = service.url.removeprefix("http://")
    outputs = []
    for lang, code in walkthrough_blocks():
        code = code.replace("localhost:8000", host)
        if lang == "sh":
            if "/result" in code:  # "a moment later"
                for job_id in (2, 3):
                    assert service.wait_state(job_id)["state"] == "succeeded"
        r = run_block(lang, code, tmp_path)
        assert r.returncode == 0, (code, r.stderr)
        outputs.append(r.stdout)
        if '"name": "iris-mlp"' in code:
            submitted = json.loads(r.stdout)
            assert submitted["id"] == 1 and submitted["state"] == "queued"
            assert service.wait_state(1)["state"] == "succeeded"
    assert len(outputs) == 7
    status, _ = json.JSONDecoder().raw_decode(outputs[1])  # curl prints the documents back to back
    assert status["progress"] == {"epoch": 100, "epochs": 100} and status["result"]["val_accuracy"] >= 0.9
    assert (tmp_path / "iris.safetensors").stat().st_size > 0 and (tmp_path / "iris.pt").stat().st_size > 0
    assert '"class":"setosa"' in outputs[5].replace(" ", "")
    assert '"accuracy"' in outputs[5] and '"confusion_matrix"' in outputs[5]
    # The Python client: the same service, the same model.
    assert outputs[6].strip() == "virginica"
    assert (tmp_path / "iris-again.safetensors").read_bytes() == (tmp_path / "iris.safetensors").read_bytes()


def test_readme_plugins_section(service, tmp_path):
    """Your own code: the example plugin's model, dataset and entrypoint, by curl and by the client."""
    service.start_worker("cpu")
    host = service.url.removeprefix("http://")
    shell, python = blocks("Your own code: plugins and `run` jobs", "docs/plugins.md")[-3:-1]
    assert shell[0] == "sh" and python[0] == "python"
    r = run_block(*shell[:1], shell[1].replace("localhost:8000", host), tmp_path)
    assert r.returncode == 0, r.stderr
    catalog, *submitted = documents(r.stdout)
    assert {p["name"] for p in catalog["plugins"]} == {"tinynet", "blobs", "cifar_loop"}
    assert [j["kind"] for j in submitted] == ["train", "train", "run"]
    for j in submitted:
        assert service.wait_state(j["id"], timeout=120)["state"] == "succeeded"
    tiny, blobs = (service.wait_state(j["id"]) for j in submitted[:2])
    assert tiny["result"]["val_accuracy"] >= 0.9 and blobs["result"]["val_accuracy"] >= 0.9

    r = run_block(*python[:1], python[1].replace("localhost:8000", host), tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines[:2]] == [["epoch", "1"], ["epoch", "2"]]
    assert lines[2] == "succeeded" and lines[3] in ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse",
                                                    "ship", "truck")
    assert (tmp_path / "cifar.safetensors").stat().st_size > 200_000
