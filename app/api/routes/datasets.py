"""Routes for uploaded datasets: upload (multipart), list, read, delete. The package app/uploads does the work;
a user sees and deletes only their project's datasets (another's is 404 as a missing one), admins all."""
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Request, Response, UploadFile
from fastapi import Path as PathParam
from pydantic import BaseModel, Field

from trainyard.app import uploads
from trainyard.app.accounts import audit, quotas
from trainyard.app.api.deps import EngineDep, SettingsDep, WhoDep, client_address
from trainyard.app.api.schemas import responses
from trainyard.app.core.errors import Conflict
from trainyard.app.core.settings import Settings
from trainyard.app.db import read
from trainyard.app.lifecycle import references

FORM_OVERHEAD_BYTES = 64 << 10  # multipart boundaries, part headers and the label_column field
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
    stored_bytes: int = Field(description="size of the stored, normalised, compressed data.npz")
    pixels: bool = Field(False, description="x is uint8 images (scaled like the built-in image datasets)")
    created_at: datetime
    owner: str | None = Field(None, description="who uploaded it (it is their project's); null: from before accounts")

    @classmethod
    def from_meta(cls, meta: dict) -> "DatasetPublic":
        return cls(**meta, dataset=f"upload:{meta['id']}")


class DatasetsPublic(BaseModel):
    data: list[DatasetPublic]
    count: int


def make_router(settings: Settings) -> APIRouter:
    """The routes, with the upload's body limit from the settings (the app caps other bodies at 1 MiB)."""
    router = APIRouter(prefix="/datasets", tags=["datasets"])
    router.add_api_route(
        "", upload_dataset, methods=["POST"], status_code=201, response_model=DatasetPublic,
        operation_id="upload_dataset", max_body_size=settings.max_upload_bytes + FORM_OVERHEAD_BYTES,
        form_limits={"max_files": 1, "max_fields": 4},
        responses=responses(too_large="the file (or what it unpacks to) is over a limit or the quota",
                            conflict="the project stores its stored_bytes limit or more"))
    router.add_api_route("", list_datasets, methods=["GET"], response_model=DatasetsPublic,
                         operation_id="list_datasets")
    missing = responses(not_found="no such dataset")
    kept = {**missing, **responses(conflict="a queued or running job uses it")}
    router.add_api_route("/{dataset_id}", get_dataset, methods=["GET"], response_model=DatasetPublic, responses=missing,
                         operation_id="get_dataset")
    router.add_api_route("/{dataset_id}", delete_dataset, methods=["DELETE"], status_code=204,
                         response_class=Response, responses=kept, operation_id="delete_dataset")
    return router


def upload_dataset(
        file: Annotated[UploadFile, File(description=f"the data: {uploads.ACCEPTED}")],
        settings: SettingsDep, engine: EngineDep, who: WhoDep, request: Request,
        label_column: Annotated[str | None, Form(max_length=1000, description="CSV: the column of class labels")]
        = None) -> DatasetPublic:
    """Validate and store a dataset, the caller's in their project; their project's train and predict jobs then
    name it as `upload:<id>`. 409 while their project stores its stored_bytes limit or more."""
    quotas.check_storage(engine, who)
    meta = uploads.store(file.file, file.filename, settings.store, label_column,
                         uploads.Limits.from_settings(settings), who)
    audit.record(engine, who, "upload", f"dataset {meta['id']}", client_address(request),
                 {"name": meta["name"], "format": meta["format"], "stored_bytes": meta["stored_bytes"]})
    return DatasetPublic.from_meta(meta)


def list_datasets(settings: SettingsDep, who: WhoDep) -> DatasetsPublic:
    metas = uploads.list_all(settings.store, who)
    return DatasetsPublic(data=[DatasetPublic.from_meta(m) for m in metas], count=len(metas))


def get_dataset(dataset_id: DatasetId, settings: SettingsDep, who: WhoDep) -> DatasetPublic:
    return DatasetPublic.from_meta(uploads.get(settings.store, dataset_id, who=who))


def delete_dataset(dataset_id: DatasetId, settings: SettingsDep, engine: EngineDep, who: WhoDep,
                   request: Request) -> Response:
    """Delete an uploaded dataset; while a queued or running job uses it, 409 naming the job. (A job submitted
    as it is deleted fails when it starts, saying the dataset was deleted.)"""
    uploads.get(settings.store, dataset_id, who=who)  # another project's: 404 before anything is said of it
    with read(engine) as conn:
        why = references.why_dataset_kept(conn, dataset_id)
    if why:
        raise Conflict(why)
    uploads.delete(settings.store, dataset_id, who)
    audit.record(engine, who, "dataset_delete", f"dataset {dataset_id}", client_address(request))
    return Response(status_code=204)
