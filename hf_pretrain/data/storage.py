"""Input in object storage: an fsspec URL (`s3://bucket/prefix`, `gs://...`, `hf://...`, `file://...`) listed,
opened and signed like a local folder, streamed (no copy of the corpus on the launching machine).

`is_url` tells a URL from a local path; `list_objects` lists the objects under it (or the one object it names)
with their fsspec info, and turns every failure into one line naming the field, the URL and the fix
(`ValueError`): a missing bucket, nothing under the prefix, refused or missing credentials, a protocol whose
package is not installed. `open_binary` opens a local path or a URL for reading in blocks; `stat` and
`signature` give each object's size and version (its ETag, else the fields fsspec's backends name their version
or modification time by), so a changed object changes the documents stage's key.

Credentials and endpoints come from the usual environment of each backend, as datatrove's readers take them:
s3fs reads `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (or `AWS_PROFILE`), and `AWS_ENDPOINT_URL` (botocore)
or `FSSPEC_S3_ENDPOINT_URL` (fsspec's config, read when fsspec is imported) for a non-AWS endpoint; gcsfs
`GOOGLE_APPLICATION_CREDENTIALS`; the Hub `HF_TOKEN`.

Why not datatrove's `DataFolder` (`get_datafolder`): it is fsspec's `DirFileSystem` over `url_to_fs`, the call
used here, rooted at the prefix. The reader needs what it leaves out: each object's info from the one listing
(`DataFolder.list_files` keeps the names only), a URL that names one object (a `DirFileSystem` rooted at a file
names it ""), and full URLs as plain strings, which `datasets`' worker processes reopen and its cache keys hash.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO

BUFFER = 1 << 20  # bytes read from the object at once: fsspec's own readline reads a whole block per line
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "blob_id", "generation", "mtime", "LastModified", "updated")
DISK_MARKS = ("dataset_info.json", "dataset_dict.json")
FIXES = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to keys that may read it, and "
    "AWS_ENDPOINT_URL for a non-AWS endpoint",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a key file that may read it",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS to a key file that may read it",
    "hf": "set HF_TOKEN to a token that may read it",
}


def is_url(path: str | Path) -> bool:
    """Whether `path` is an fsspec URL (`protocol://...`) rather than a local path."""
    return isinstance(path, str) and "://" in path


def _filesystem(url: str, field: str):
    from fsspec.core import url_to_fs

    try:
        return url_to_fs(url)
    except ImportError as err:  # e.g. "Install s3fs to access S3"
        fix = "pip install 'hf_pretrain[s3]'" if url.startswith("s3://") else "pip install the package it names"
        raise ValueError(f"{field}={url!r}: {err}; {fix}.") from None
    except ValueError as err:  # "Protocol not known: ..."
        raise ValueError(f"{field}={url!r}: {err}; use a protocol fsspec knows (s3, gs, hf, file, ...).") from None


def _refused(field: str, url: str, err: Exception) -> ValueError:
    """The one line for a listing that failed: what the storage said and the fix."""
    protocol = url.split("://", 1)[0]
    credentials = FIXES.get(protocol, "give the credentials its fsspec backend reads from the environment")
    said = f"{type(err).__name__}: {err}"
    if isinstance(err, FileNotFoundError):
        what = "no such bucket" if "bucket" in str(err).lower() else "not found"
        return ValueError(f"{field}={url!r}: {what} ({said}); check the bucket's name and the endpoint.")
    if isinstance(err, PermissionError) or "credential" in type(err).__name__.lower():
        return ValueError(f"{field}={url!r}: access refused ({said}); {credentials}.")
    return ValueError(f"{field}={url!r}: cannot be listed ({said}); check the URL, the endpoint and {credentials}.")


def list_objects(url: str, field: str = "input") -> dict[str, dict]:
    """The objects under `url` (every depth, or the one object it names), as full URLs in order, with their info."""
    fs, root = _filesystem(url, field)
    try:
        found = fs.find(root, detail=True)
    except Exception as err:  # noqa: BLE001 - every backend raises its own: named in the line
        raise _refused(field, url, err) from None
    found = {fs.unstrip_protocol(path): info for path, info in sorted(found.items()) if info.get("type") != "directory"}
    if not found:
        raise ValueError(f"{field}={url!r}: nothing is stored under this URL; check the prefix (and the bucket).")
    if {relative_name(url, name) for name in found} & set(DISK_MARKS):
        raise ValueError(
            f"{field}={url!r} is a save_to_disk folder: not read from a URL yet; pass the prefix of its "
            "data files, or copy it to a local folder."
        )
    return found


def relative_name(url: str, name: str) -> str:
    """How ids name the object `name` listed under `url`: its path below the prefix (its name for one object)."""
    prefix = url.split("://", 1)[1].rstrip("/")
    path = name.split("://", 1)[1]
    return path[len(prefix) + 1 :] if path.startswith(prefix + "/") else path.rsplit("/", 1)[-1]


def version(info: dict) -> str:
    """The object's version as its backend names it (the first of `VERSION_FIELDS` it has)."""
    return next((str(info[k]) for k in VERSION_FIELDS if info.get(k) is not None), "")


def stat(path: str | Path) -> tuple[int, int | str]:
    """Size and version of a local file (modification time, ns) or an object (ETag or the like)."""
    if not is_url(path):
        found = Path(path).stat()
        return found.st_size, found.st_mtime_ns
    fs, root = _filesystem(str(path), "input")
    info = fs.info(root)
    return int(info["size"]), version(info)


def signature(url: str) -> list:
    """Each object under `url` with its size and version: what the documents stage read."""
    return [[name, int(info["size"]), version(info)] for name, info in list_objects(url).items()]


def open_binary(path: str | Path) -> BinaryIO:
    """The bytes of a local file or of an object, read in blocks of `BUFFER` as they are consumed."""
    if not is_url(path):
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    fs, root = _filesystem(str(path), "input")
    return io.BufferedReader(fs.open(root, "rb"), buffer_size=BUFFER)
