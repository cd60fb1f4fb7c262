"""Data in object storage: the chain's input and output at an fsspec URL (`s3://bucket/prefix`, `gs://...`, `hf://...`, `file://...`) listed,
opened and signed like a local folder, streamed (no copy of the corpus on the launching machine).

`is_url` tells a URL from a local path; `list_objects` lists the objects under it (or the one object it names)
with their fsspec info, and turns every failure into one line naming the field, the URL and the fix
(`ValueError`): a missing bucket, nothing under the prefix, refused or missing credentials, a protocol whose
package is not installed. A listing of millions of objects is thousands of requests and minutes: within
`one_listing_per_url()` (the chain's launch holds it for its whole run) each URL is listed once per process, so
the launch lists its input once (shard count and stage key alike) and each documents task once for its shard, as
datatrove's readers do; the stage key and the shards then come from the same listing. `open_binary` opens a local path or a URL for reading in blocks; `stat` and
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

Output (`chain/run.py` says why the chain works in a local folder and publishes): `check_output` is the one line
for an output URL that cannot be listed (a wrong bucket, refused credentials) before any work; `publish` uploads a
local folder's files under a URL with the same relative names (what was there first removed), `publish_text` a
small file only when its bytes changed (so a relaunch rewrites nothing it did not change), `remove` drops a prefix.
`download` is the way back: a URL's objects copied once into `cache_root()/downloads/KEY`, KEY a hash of the
objects' names, sizes and versions (a republished shard is a new copy), because training memory-maps local Arrow
files and `AutoTokenizer` loads a local folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import BinaryIO

BUFFER = 1 << 20  # bytes read from the object at once: fsspec's own readline reads a whole block per line
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "blob_id", "generation", "mtime", "LastModified", "updated")
DISK_MARKS = ("dataset_info.json", "dataset_dict.json")
FIXES = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to keys that may {verb} it, and "
    "AWS_ENDPOINT_URL for a non-AWS endpoint",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a key file that may {verb} it",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS to a key file that may {verb} it",
    "hf": "set HF_TOKEN to a token that may {verb} it",
}
COMPLETE = ".complete"  # written last into a download's folder: a copy without it is redone
_listings: dict[str, dict[str, dict]] | None = None  # within one_listing_per_url(): each URL's one listing


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
    fix = FIXES.get(protocol, "give the credentials its fsspec backend reads from the environment")
    credentials = fix.format(verb="write" if field == "output_dir" else "read")
    said = f"{type(err).__name__}: {err}"
    if isinstance(err, FileNotFoundError):
        what = "no such bucket" if "bucket" in str(err).lower() else "not found"
        return ValueError(f"{field}={url!r}: {what} ({said}); check the bucket's name and the endpoint.")
    if isinstance(err, PermissionError) or "credential" in type(err).__name__.lower():
        return ValueError(f"{field}={url!r}: access refused ({said}); {credentials}.")
    return ValueError(f"{field}={url!r}: cannot be listed ({said}); check the URL, the endpoint and {credentials}.")


@contextlib.contextmanager
def one_listing_per_url():
    """Within it, `list_objects` lists each URL once and answers again from that listing (module docstring)."""
    global _listings
    outer = _listings
    _listings = {} if outer is None else outer
    try:
        yield
    finally:
        _listings = outer


def list_objects(url: str, field: str = "input") -> dict[str, dict]:
    """The objects under `url` (every depth, or the one object it names), as full URLs in order, with their info."""
    if _listings is not None and url in _listings:
        return dict(_listings[url])
    found = _list_objects(url, field)
    if _listings is not None:
        _listings[url] = dict(found)
    return found


def _list_objects(url: str, field: str) -> dict[str, dict]:
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


def cache_root() -> Path:
    """Where the chain's default work folders and the downloads of URLs go: `$HF_PRETRAIN_CACHE`, else
    `~/.cache/hf_pretrain`."""
    return Path(os.environ.get("HF_PRETRAIN_CACHE") or Path.home() / ".cache" / "hf_pretrain")


def config_key(*parts) -> str:
    """A short hash of `parts` (JSON, keys sorted): the identity of a stage's settings, or of a cached copy."""
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def join(base: str | Path, *parts: str) -> str | Path:
    """`base/parts...`: a local path, or a URL with `/` between the parts."""
    return "/".join([str(base).rstrip("/"), *parts]) if is_url(base) else Path(base).joinpath(*parts)


def check_output(url: str, field: str = "output_dir") -> None:
    """One line, before any work, when the output URL cannot be listed (a wrong bucket, refused credentials)."""
    fs, root = _filesystem(url, field)
    try:
        fs.find(root)  # one flat listing; with a maxdepth, fsspec's walk would swallow a missing bucket
    except Exception as err:  # noqa: BLE001 - every backend raises its own: named in the line
        raise _refused(field, url, err) from None


def exists(url: str) -> bool:
    fs, root = _filesystem(url, "output_dir")
    return fs.exists(root)


def remove(url: str) -> None:
    """Every object under `url` (or the one it names) removed; nothing there is no error."""
    fs, root = _filesystem(url, "output_dir")
    if fs.exists(root):
        fs.rm(root, recursive=True)
    fs.invalidate_cache()


def publish(local: Path, url: str) -> None:
    """`local`'s files uploaded under `url`, each at its path below `local`; what was under `url` removed first (an
    interrupted upload's objects). File by file, so no backend's rule for copying into an existing prefix applies."""
    remove(url)
    fs, root = _filesystem(url, "output_dir")
    files = sorted(p for p in local.rglob("*") if p.is_file())
    fs.put([str(p) for p in files], [f"{root}/{p.relative_to(local).as_posix()}" for p in files])


def publish_text(url: str, text: str) -> bool:
    """`text` written to the object `url` unless it holds those bytes already; whether it was written."""
    fs, root = _filesystem(url, "output_dir")
    if fs.exists(root) and fs.cat_file(root) == text.encode():
        return False
    fs.pipe_file(root, text.encode())
    return True


def glob(url: str, pattern: str) -> list[str]:
    """The full URLs of the objects or prefixes directly under `url` whose names match `pattern`, in order."""
    fs, root = _filesystem(url, "output_dir")
    fs.invalidate_cache()  # another process (a task) may have written there since this one listed
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(f"{root.rstrip('/')}/{pattern}"))


def download(url: str) -> Path:
    """A local copy of the objects under `url` (same relative names), made once per version of them: the folder
    `cache_root()/downloads/KEY` (module docstring)."""
    fs, root = _filesystem(url, "input")
    fs.invalidate_cache()
    found = {p: info for p, info in sorted(fs.find(root, detail=True).items()) if info.get("type") != "directory"}
    if not found:
        raise FileNotFoundError(f"{url!r}: nothing is stored under this URL; run `hf-pretrain data prepare` first.")
    key = config_key(url, [[p, int(info["size"]), version(info)] for p, info in found.items()])
    local = cache_root() / "downloads" / key
    if (local / COMPLETE).exists():
        return local
    tmp = local.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    names = [p[len(root.rstrip("/")) + 1 :] for p in found]
    for name in names:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
    fs.get(list(found), [str(tmp / name) for name in names])
    (tmp / COMPLETE).write_text(url)
    shutil.rmtree(local, ignore_errors=True)  # an interrupted copy (no COMPLETE)
    try:
        tmp.rename(local)
    except OSError:  # another process made the same copy first
        shutil.rmtree(tmp)
    return local
