"""The data directory's layout: the one place that knows where each kind of file lives.

    artifacts/<job>/run-<claim>/   model.safetensors, model.pt, meta.json (train); result.json (predict);
                                   model.onnx, model.pt2, model.torchscript.pt (exports, made on first request)
    checkpoints/<job>/run-<claim>-e<epoch>-s<step>.pt
    logs/<job>.log                 what a job printed, all its runs (capped: worker/supervisor/joblog.py)
    tensorboard/<job>/             a train or run job's TensorBoard event files, a file per run (worker/event_files.py)
    scratch/<job>/run-<claim>/     a run job's ctx.data_dir, removed when the run ends
    datasets/uploads/<id>/         data.npz, meta.json
    datasets/cache/                decoded built-in datasets and FakeData (evicted least recently used)
    datasets/raw/                  torchvision's downloaded files

The database stores paths relative to the root (what `rel` returns), so a data directory can move.
Torch-free: the API and the worker both use it.
"""
import fcntl
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainyard.app.core.errors import Invalid, NotFound

ARTIFACT_FILES = {"safetensors": "model.safetensors", "pt": "model.pt", "meta": "meta.json"}
# The model exported with its input normalisation built in (app/jobs/exports.py, worker/export.py).
EXPORT_FILES = {"onnx": "model.onnx", "pt2": "model.pt2", "torchscript": "model.torchscript.pt"}
RESULT_FILE = "result.json"
UPLOAD_DATA_FILE, UPLOAD_META_FILE = "data.npz", "meta.json"
UPLOAD_ID = re.compile(r"[a-z0-9]{1,64}")


class Layout:
    def __init__(self, root: Path):
        self.root = Path(root)

    def ensure(self) -> None:
        for sub in ("artifacts", "checkpoints", "logs", "datasets"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def rel(self, path: Path) -> str:
        path = Path(path)
        try:
            return str(path.relative_to(self.root))
        except ValueError:  # one side resolved (resolve() below gives absolute paths), the other not
            return str(path.resolve().relative_to(self.root.resolve()))

    def resolve(self, rel: str | Path) -> Path:
        """A path the database or a client names, under the root; anything that would leave it is refused."""
        base = self.root.resolve()
        path = (base / rel).resolve()
        if not path.is_relative_to(base):
            raise Invalid("path outside the data directory")
        return path

    # -- jobs -------------------------------------------------------------------------------------

    def run_dir(self, job_id: int, claim: int) -> Path:
        """Where one run of a job writes its artifact or result: a stale run never overwrites another's."""
        return self.root / "artifacts" / str(job_id) / f"run-{claim}"

    def checkpoint_stem(self, job_id: int, claim: int) -> Path:
        """Each checkpoint of a run is a file of its own beside this stem (see JobContext.checkpoint_file)."""
        return self.checkpoints(job_id) / f"run-{claim}.pt"

    def checkpoints(self, job_id: int) -> Path:
        return self.root / "checkpoints" / str(job_id)

    def tensorboard(self, job_id: int) -> Path:
        """A job's TensorBoard event files, every run's (`tensorboard --logdir <root>/tensorboard`: a run per job)."""
        return self.root / "tensorboard" / str(job_id)

    @property
    def housekeeping_lock(self) -> Path:
        """Held by the one server process of this host that runs the lease reaper (serve --workers N)."""
        return self.root / "housekeeping.lock"

    @property
    def sweeps_lock(self) -> Path:
        """Held by the one server process of this host that advances sweeps (app/sweeps/search.py)."""
        return self.root / "sweeps.lock"

    def log(self, job_id: int) -> Path:
        return self.root / "logs" / f"{job_id}.log"

    def scratch(self, job_id: int, claim: int | None = None) -> Path:
        """A run job's own directory for one run (ctx.data_dir), or with no claim every run's of the job."""
        folder = self.root / "scratch" / str(job_id)
        return folder if claim is None else folder / f"run-{claim}"

    # -- datasets ---------------------------------------------------------------------------------

    def uploads(self) -> Path:
        return self.root / "datasets" / "uploads"

    def upload(self, upload_id: str) -> Path:
        if not UPLOAD_ID.fullmatch(upload_id):  # ids come from validated specs and routes; be sure anyway
            raise NotFound(f"no uploaded dataset {upload_id!r}")
        return self.uploads() / upload_id

    def dataset_cache(self) -> Path:
        return self.root / "datasets" / "cache"

    def raw_datasets(self) -> Path:
        return self.root / "datasets" / "raw"

    def dataset_lock(self, name: str) -> Path:
        return self.root / "datasets" / f".{name}.lock"


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on a lock file: processes sharing the data directory on one host (workers
    decoding a dataset, servers committing an upload) take their turns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
