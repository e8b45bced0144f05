"""Where a run's checkpoints live, as a job file names it (``checkpoints: {dir: ...}``): which
places a storage serves, which of them are local, and the environment an object store's backend
reads. Torch-free and pure (the environment is passed in), for the supervisor.

A place is a plain path (or a ``file://`` URL), served by
:class:`~.storage.PosixStorage`, or an object store's URL of
:data:`~.storage.OBJECT_STORE_SCHEMES` (``s3://bucket/prefix``), served by
:class:`~.fsspec_storage.FsspecStorage`. The backend of an object store (s3fs and botocore for
S3) finds its endpoint, region, retries and credentials in the process's environment:
:data:`STORE_VARIABLES` names them, so that the supervisor can send the values it holds to ranks
that run where its environment is not (the nodes of a remote Ray cluster).
"""

from __future__ import annotations

from collections.abc import Mapping

from . import storage
from .storage import LOCAL_SCHEMES, scheme_of

__all__ = [
    "LOCAL_SCHEMES",
    "STORE_VARIABLES",
    "is_local",
    "local_path",
    "problem",
    "store_environment",
    "store_variables",
]

_S3 = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_CA_BUNDLE",
)
_GCS = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")
_AZURE = (
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_STORAGE_TENANT_ID",
)
STORE_VARIABLES: dict[str, tuple[str, ...]] = {
    "s3": _S3,
    "s3a": _S3,
    "gs": _GCS,
    "gcs": _GCS,
    "az": _AZURE,
    "abfs": _AZURE,
}
"""Per object-store scheme (every one of :data:`~.storage.OBJECT_STORE_SCHEMES`), the standard
environment variables its backend reads: credentials, endpoint, region, retries (botocore's for
S3, google-auth's for GCS, adlfs's for Azure). A file they name (``AWS_CA_BUNDLE``,
``GOOGLE_APPLICATION_CREDENTIALS``) must exist where the ranks run."""


def is_local(place: str) -> bool:
    """Whether ``place`` is on a filesystem (a plain path, ``file://``), not an object store."""
    return storage.local_path(place) is not None


def local_path(place: str) -> str:
    """The path of a local ``place`` (:func:`.storage.local_path`); another place as it is."""
    path = storage.local_path(place)
    return place if path is None else path


def problem(place: str) -> str | None:
    """Why ``place`` cannot hold checkpoints (its scheme is no storage's, an object-store URL
    without a bucket), in words; None when it can (whether it can be reached is not told)."""
    scheme = scheme_of(place)
    if scheme in LOCAL_SCHEMES:
        return None if local_path(place) else "an empty path"
    if scheme not in storage.schemes():
        served = ", ".join(f"{s}://" for s in storage.schemes() if s not in LOCAL_SCHEMES)
        return (
            f"{place!r}: no checkpoint storage serves {scheme}:// URLs (a plain path, file:// "
            f"or an object store: {served})"
        )
    if not place.split("://", 1)[1].split("/", 1)[0]:
        return f"{place!r}: an object-store URL names its bucket ({scheme}://BUCKET/PREFIX)"
    return None


def store_variables(place: str) -> tuple[str, ...]:
    """The environment variables the backend of ``place`` reads (none for a local place)."""
    return STORE_VARIABLES.get(scheme_of(place), ())


def store_environment(place: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of :func:`store_variables` that ``environ`` sets (to a non-empty value),
    with their values: what the ranks need to reach ``place`` as the supervisor does."""
    return {name: environ[name] for name in store_variables(place) if environ.get(name)}
