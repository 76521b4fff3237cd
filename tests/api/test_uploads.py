"""Your own data: uploads (CSV, .npz, ImageFolder zip) trained on and evaluated by real jobs, and
malformed uploads refused naming the field. One live server and CPU worker for the module."""
import io
import json
import zipfile

import numpy as np
import pytest
from PIL import Image

from tests.helpers.data import iris_csv
from tests.helpers.jobs import IRIS_JOB
from tests.helpers.service import live_service
from trainyard.app import uploads
from trainyard.app.core import errors

pytestmark = pytest.mark.slow  # starts the real server and workers

MAX_BYTES, MAX_FILES = 256 << 10, 100  # small limits so that the limit cases stay small and fast


live = live_service(env={"TRAINYARD_MAX_UPLOAD_BYTES": str(MAX_BYTES), "TRAINYARD_MAX_UPLOAD_FILES": str(MAX_FILES)})


def upload(live, name: str, content: bytes, **form) -> dict:
    with live.client() as c:
        r = c.post("/datasets", files={"file": (name, content)}, data=form)
    assert r.status_code == 201, r.text
    return r.json()


def run(live, body: dict) -> dict:
    job = live.wait_state(live.submit(body)["id"])
    assert job["state"] == "succeeded", job
    return job


# --- files --------------------------------------------------------------------------------------------


def npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def blobs(n: int = 90, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = np.array([3, 7, 42])[np.arange(n) % 3]  # arbitrary integers: classes "3", "7", "42"
    centers = {3: 0.0, 7: 4.0, 42: 8.0}
    x = rng.normal(size=(n, 5)) + np.array([centers[v] for v in labels])[:, None]
    return x, labels


def png(value: float, seed: int, size=(8, 8), mode="L") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(rng.normal(value, 20, size=size[::-1]), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def zipped(members: dict[str, bytes], symlinks: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            if name in symlinks:
                info.external_attr = (0o120777 << 16)
            zf.writestr(info, data)
    return buf.getvalue()


def image_folder(per_class: int = 20) -> dict[str, bytes]:
    """Two classes told apart by brightness, zipped as the folder itself (a top folder above the classes)."""
    files = {f"shapes/{cls}/{i:02d}.png": png(value, seed=i + 100 * (cls == "dark"))
             for cls, value in (("bright", 190), ("dark", 60)) for i in range(per_class)}
    return {**files, "shapes/README.txt": b"ignored", "__MACOSX/shapes/._01.png": b"junk"}


# --- uploads that train -------------------------------------------------------------------------------

def test_csv_upload_trains_and_predicts_like_the_builtin_iris(live):
    meta = upload(live, "iris.csv", iris_csv(), label_column="species")
    assert meta["dataset"] == f"upload:{meta['id']}" and meta["format"] == "csv" and meta["name"] == "iris.csv"
    assert meta["samples"] == 150 and meta["input_shape"] == [4] and meta["label_column"] == "species"
    assert meta["classes"] == ["setosa", "versicolor", "virginica"]

    job = run(live, {**IRIS_JOB, "data": {**IRIS_JOB["data"], "dataset": meta["dataset"]}})
    assert job["result"]["val_accuracy"] >= 0.9
    assert job["result"]["class_names"] == ["setosa", "versicolor", "virginica"]
    # The same rows in the same order: the very same training run as the shipped iris.
    builtin = run(live, IRIS_JOB)
    assert job["result"]["val_accuracy"] == builtin["result"]["val_accuracy"]

    ev = run(live, {"kind": "predict", "model_job": job["id"], "data": {"dataset": meta["dataset"], "split": "val"}})
    with live.client() as c:
        result = c.get(f"/jobs/{ev['id']}/result").json()
        assert result["accuracy"] == job["result"]["val_accuracy"] and result["samples"] == 30
        assert set(result["per_class_accuracy"]) == {"setosa", "versicolor", "virginica"}
        rows = run(live, {"kind": "predict", "model_job": job["id"], "inputs": [[5.1, 3.5, 1.4, 0.2]]})
        assert c.get(f"/jobs/{rows['id']}/result").json()["predictions"][0]["class"] == "setosa"


def test_npz_upload_with_arbitrary_integer_labels(live):
    x, y = blobs()
    meta = upload(live, "blobs.npz", npz(x=x, y=y))
    assert meta["format"] == "npz" and meta["samples"] == 90 and meta["input_shape"] == [5]
    assert meta["classes"] == ["3", "7", "42"]  # sorted as numbers, named as given
    job = run(live, {"kind": "train", "model": {"arch": "mlp", "hidden": [16]}, "data": {"dataset": meta["dataset"]},
                     "train": {"epochs": 30, "batch_size": 16, "lr": 0.01}, "device": "cpu"})
    assert job["result"]["val_accuracy"] >= 0.9 and job["result"]["class_names"] == ["3", "7", "42"]


def test_imagefolder_zip_trains_a_cnn(live):
    meta = upload(live, "shapes.zip", zipped(image_folder()))
    assert meta["format"] == "imagefolder" and meta["samples"] == 40
    assert meta["input_shape"] == [1, 8, 8] and meta["classes"] == ["bright", "dark"]  # grayscale: one channel
    job = run(live, {"kind": "train", "model": {"arch": "cnn", "channels": [8]},
                     "data": {"dataset": meta["dataset"], "val_fraction": 0.25},
                     "train": {"epochs": 15, "batch_size": 8, "lr": 0.01}, "device": "cpu"})
    assert job["result"]["val_accuracy"] >= 0.9 and job["result"]["input_shape"] == [1, 8, 8]
    ev = run(live, {"kind": "predict", "model_job": job["id"], "data": {"dataset": meta["dataset"], "split": "all"}})
    assert ev["result"]["accuracy"] >= 0.9


def test_list_get_and_delete(live):
    meta = upload(live, "../../etc/passwd.csv", iris_csv(), label_column="species")
    assert meta["name"] == "passwd.csv"  # a display name only; the id names the directory
    with live.client() as c:
        listed = c.get("/datasets").json()
        assert listed["count"] == len(listed["data"]) and listed["data"][0]["id"] == meta["id"]  # newest first
        assert c.get(f"/datasets/{meta['id']}").json() == meta
        assert c.delete(f"/datasets/{meta['id']}").status_code == 204
        assert c.get(f"/datasets/{meta['id']}").status_code == 404
        assert c.delete(f"/datasets/{meta['id']}").status_code == 404
        assert meta["id"] not in {d["id"] for d in c.get("/datasets").json()["data"]}
        assert c.get("/datasets/NOT-AN-ID").status_code == 422
        # A job naming a deleted upload is refused at submit (a job queued before the delete fails on its
        # worker saying so: test_data.py::test_missing_upload_is_a_clear_job_error).
        r = c.post("/jobs", json={**IRIS_JOB, "data": {"dataset": meta["dataset"]}})
        assert r.status_code == 422 and "does not exist" in r.text and r.json()["detail"][0]["loc"][-1] == "dataset"


# --- uploads that are refused -------------------------------------------------------------------------

IRIS = iris_csv().decode()
x, y = blobs()
MALFORMED = {
    "bad extension": ("data.xlsx", b"PK..", {}, 422, "file", [".csv", ".npz", ".zip"]),
    "no filename extension": ("data", b"a,b\n", {}, 422, "file", ["unknown extension"]),
    "empty file": ("empty.csv", b"", {"label_column": "species"}, 422, "file", ["empty"]),
    "no label_column": ("iris.csv", IRIS.encode(), {}, 422, "label_column", ["required", "species"]),
    "label_column not a column": ("iris.csv", IRIS.encode(), {"label_column": "kind"}, 422, "label_column",
                                  ["'kind'", "sepal_length", "species"]),
    "label_column for an npz": ("b.npz", npz(x=x, y=y), {"label_column": "y"}, 422, "label_column", [".csv"]),
    "no header": ("iris.csv", IRIS.split("\n", 1)[1].replace("setosa", "0").replace("versicolor", "1")
                  .replace("virginica", "2").encode(), {"label_column": "species"}, 422, "file", ["header"]),
    "non-numeric feature": ("iris.csv", IRIS.replace("4.9,3.0", "4.9,abc", 1).encode(), {"label_column": "species"},
                            422, "file", ["'sepal_width'", "row 2", "'abc'"]),
    "ragged row": ("iris.csv", IRIS.replace("4.9,3.0,", "4.9,", 1).encode(), {"label_column": "species"},
                   422, "file", ["row 2", "4 values"]),
    "one class": ("one.csv", ("a,b,c\n" + "1,2,x\n" * 20).encode(), {"label_column": "c"}, 422, "file", ["2 classes"]),
    "too few samples": ("few.csv", b"a,b,c\n1,2,x\n3,4,y\n", {"label_column": "c"}, 422, "file", ["2 samples"]),
    "not utf-8": ("latin.csv", "a,b,c\n1,2,caf\xe9\n".encode("latin-1"), {"label_column": "c"}, 422, "file", ["UTF-8"]),
    "npz with a pickled object array": ("evil.npz", npz(x=np.array([{"a": 1}] * 12, dtype=object), y=np.arange(12)),
                                        {}, 422, "file", ["'x'", "objects", "unpickling"]),
    "npz without y": ("b.npz", npz(x=x), {}, 422, "file", ["'y'", "missing"]),
    "npz lengths differ": ("b.npz", npz(x=x, y=y[:-1]), {}, 422, "file", ["90 samples", "89"]),
    "npz with NaN": ("b.npz", npz(x=np.where(np.arange(90)[:, None] == 5, np.nan, x), y=y), {}, 422, "file",
                     ["NaN", "sample 5"]),
    "npz with text x": ("b.npz", npz(x=np.array([["a"] * 3] * 12), y=np.arange(12) % 2), {}, 422, "file", ["numeric"]),
    "not an npz": ("b.npz", b"\x00" * 100, {}, 422, "file", [".npz"]),
    "not a zip": ("a.zip", b"hello, world" * 10, {}, 422, "file", ["zip"]),
    "zip with ../ member": ("a.zip", zipped({**image_folder(), "../evil.png": png(0, 0)}), {}, 422, "file",
                            ["'../evil.png'", ".."]),
    "zip with absolute member": ("a.zip", zipped({**image_folder(), "/tmp/evil.png": png(0, 0)}), {}, 422, "file",
                                 ["absolute"]),
    "zip with a symlink": ("a.zip", zipped({**image_folder(), "shapes/dark/link.png": b"/etc/passwd"},
                                           symlinks=("shapes/dark/link.png",)), {}, 422, "file", ["symbolic link"]),
    "zip over the file-count limit": ("a.zip", zipped({f"c{i % 2}/{i}.png": b"" for i in range(MAX_FILES + 1)}),
                                      {}, 413, "file", [str(MAX_FILES + 1), str(MAX_FILES)]),
    "zip of one class": ("a.zip", zipped({f"only/{i}.png": png(0, i) for i in range(12)}), {}, 422, "file",
                         ["2 classes"]),
    "zip without images": ("a.zip", zipped({"a/readme.txt": b"hi", "b/notes.txt": b"yo"}), {}, 422, "file",
                           ["no images"]),
    "zip with images at the top": ("a.zip", zipped({"x.png": png(0, 0), "y.png": png(0, 1)}), {}, 422, "file",
                                   ["class folder"]),
    "zip with mixed image sizes": ("a.zip", zipped({**image_folder(), "shapes/dark/99.png": png(60, 1, (9, 8))}),
                                   {}, 422, "file", ["'shapes/dark/99.png'", "9x8", "same size"]),
    "zip with a broken image": ("a.zip", zipped({**image_folder(), "shapes/dark/99.png": b"not a png"}), {}, 422,
                                "file", ["'shapes/dark/99.png'", "image"]),
    "file over the upload limit": ("big.csv", b"1" * (MAX_BYTES + 1000), {"label_column": "c"}, 413, "file",
                                   ["TRAINYARD_MAX_UPLOAD_BYTES"]),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_uploads_are_refused_naming_the_field(live, case):
    name, content, form, status, field, words = MALFORMED[case]
    with live.client() as c:
        before = c.get("/datasets").json()["count"]
        r = c.post("/datasets", files={"file": (name, content)}, data=form)
        assert r.status_code == status, r.text
        (error,) = r.json()["detail"]
        assert error["loc"] == ["body", field] and error["msg"].startswith(f"{field}: ")
        for word in words:
            assert word in error["msg"], error["msg"]
        assert c.get("/datasets").json()["count"] == before
    assert not [p.name for p in (live.data_dir / "datasets" / "uploads").glob(".*")]  # no half-written upload


def test_bodies_far_over_the_limit_and_missing_files(live):
    with live.client() as c:
        r = c.post("/datasets", files={"file": ("big.csv", b"1" * (4 << 20))}, data={"label_column": "c"})
        assert r.status_code == 413
        r = c.post("/datasets", data={"label_column": "c"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "file"]


# --- the parsers on their own (limits too big for an upload in a test) --------------------------------

def test_zip_bomb_is_refused_before_inflating(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a/zeros.png", b"\0" * (2 << 20))
    assert len(buf.getvalue()) < 10_000
    with pytest.raises(errors.TooLarge, match="inflates to 2.0 MiB; the limit is 1.0 MiB") as e:
        uploads.store(buf, "bomb.zip", tmp_path, limits=uploads.Limits(max_decoded_bytes=1 << 20))
    assert e.value.status == 413


def test_images_over_the_pixel_limit_are_refused_from_their_header(tmp_path):
    with pytest.raises(errors.TooLarge, match="'shapes/bright/00.png' is 8x8 pixels") as e:
        uploads.store(io.BytesIO(zipped(image_folder())), "a.zip", tmp_path, limits=uploads.Limits(max_image_pixels=63))
    assert e.value.status == 413


def test_stored_layout_colour_images_and_string_labels(tmp_path):
    files = {f"{cls}/{i}.png": png(v, i, (6, 4), "RGB") for cls, v in (("b", 200), ("a", 20)) for i in range(6)}
    meta = uploads.store(io.BytesIO(zipped(files)), "rgb.zip", tmp_path)
    folder = tmp_path / "datasets" / "uploads" / meta["id"]
    assert sorted(p.name for p in folder.iterdir()) == ["data.npz", "meta.json"]
    assert json.loads((folder / "meta.json").read_text()) == meta
    with np.load(folder / "data.npz", allow_pickle=False) as d:
        assert d["x"].dtype == np.uint8 and d["x"].shape == (12, 3, 4, 6) and d["y"].tolist() == [0] * 6 + [1] * 6
    assert meta["classes"] == ["a", "b"] and meta["input_shape"] == [3, 4, 6]

    meta = uploads.store(io.BytesIO(npz(x=x, y=np.array(["10", "9", "2"])[np.arange(90) % 3])), "s.npz", tmp_path)
    assert meta["classes"] == ["2", "9", "10"]  # numeric strings sort as numbers
    images = np.zeros((12, 1, 4, 4), dtype=np.uint8)
    meta = uploads.store(io.BytesIO(npz(x=images, y=np.arange(12) % 2)), "img.npz", tmp_path)
    with np.load(tmp_path / "datasets" / "uploads" / meta["id"] / "data.npz") as d:
        assert d["x"].dtype == np.uint8  # uint8 N x C x H x W in an npz stays pixels
    assert [m["id"] for m in uploads.list_all(tmp_path)][0] == meta["id"]
