"""Routes for uploaded datasets: upload (multipart), list, read, delete. app/uploads.py does the work."""
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, HTTPException, Path as PathParam, Response, UploadFile
from pydantic import BaseModel, Field

from app import uploads
from app.api.deps import SettingsDep

router = APIRouter(prefix="/datasets", tags=["datasets"])
DatasetId = Annotated[str, PathParam(pattern=uploads.ID_PATTERN)]


class DatasetPublic(BaseModel):
    id: str
    dataset: str = Field(description='what a job names it by: {"data": {"dataset": "upload:<id>"}}')
    name: str = Field(description="the uploaded file's name (display only)")
    format: Literal["csv", "npz", "imagefolder"]
    samples: int
    input_shape: list[int] = Field(description="per sample: (features,) or (channels, height, width)")
    classes: list[str] = Field(description="class names; a label's index in this list is its class index")
    label_column: str | None
    bytes: int = Field(description="size of the uploaded file")
    stored_bytes: int = Field(description="size of the stored, normalised data.npz")
    created_at: datetime

    @classmethod
    def from_meta(cls, meta: dict) -> "DatasetPublic":
        return cls(**meta, dataset=f"upload:{meta['id']}")


class DatasetsPublic(BaseModel):
    data: list[DatasetPublic]
    count: int


def _refused(e: uploads.UploadError) -> HTTPException:
    # Same shape as the app's validation errors: clients parse one format.
    return HTTPException(e.status, [{"loc": ["body", e.field], "msg": str(e), "type": "value_error"}])


@router.post("", status_code=201, response_model=DatasetPublic,
             # The app caps bodies at 1 MiB; this route takes the upload limit plus the form's own bytes.
             max_body_size=uploads.MAX_UPLOAD_BYTES + uploads.FORM_OVERHEAD_BYTES,
             form_limits={"max_files": 1, "max_fields": 4},
             responses={413: {"description": "the file (or what it unpacks to) is over a limit"}})
def upload_dataset(
        file: Annotated[UploadFile, File(description=f"the data: {uploads.ACCEPTED}")],
        settings: SettingsDep,
        label_column: Annotated[str | None, Form(max_length=1000, description="CSV: the column of class labels")]
        = None) -> DatasetPublic:
    """Validate and store a dataset; train and predict jobs then name it as `upload:<id>`."""
    try:
        meta = uploads.store(file.file, file.filename, settings.data_dir, label_column)
    except uploads.UploadError as e:
        raise _refused(e) from None
    return DatasetPublic.from_meta(meta)


@router.get("", response_model=DatasetsPublic)
def list_datasets(settings: SettingsDep) -> DatasetsPublic:
    metas = uploads.list_all(settings.data_dir)
    return DatasetsPublic(data=[DatasetPublic.from_meta(m) for m in metas], count=len(metas))


@router.get("/{dataset_id}", response_model=DatasetPublic)
def get_dataset(dataset_id: DatasetId, settings: SettingsDep) -> DatasetPublic:
    try:
        return DatasetPublic.from_meta(uploads.get(settings.data_dir, dataset_id))
    except uploads.NotFound as e:
        raise HTTPException(404, str(e)) from None


@router.delete("/{dataset_id}", status_code=204, response_class=Response)
def delete_dataset(dataset_id: DatasetId, settings: SettingsDep) -> Response:
    """Delete an uploaded dataset. Jobs that use it are not checked: a queued or running job that has
    not loaded it yet fails with an error saying the dataset was deleted."""
    try:
        uploads.delete(settings.data_dir, dataset_id)
    except uploads.NotFound as e:
        raise HTTPException(404, str(e)) from None
    return Response(status_code=204)
