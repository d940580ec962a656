"""Publishing a finished local output folder to object storage (``s3://bucket/prefix``), manifest last.

Writers never write to S3 directly: ``pack-shards`` and ``precompute-features`` build their output in a local
staging folder exactly as they would anywhere else (resumable, locked, atomic), then ``publish_folder`` uploads it:

1. ``check_prefix`` lists the prefix and reads the manifest there, if any. A manifest of a different dataset (other
   plan, config or source), or objects shardcache does not write, are refused (``OutputExistsError``, exit 2)
   unless ``overwrite``; overwriting deletes the old manifest first, then shardcache's own objects, never others.
2. Every file the local manifest names (shards, tar indexes, the source index) is uploaded unless the object is
   already complete: same size and the same sha256 in its metadata (``x-amz-meta-sha256``). Above
   ``MULTIPART_THRESHOLD`` boto3 uploads in parts. After each upload a HEAD checks size and sha256 again.
3. The manifest goes last, so a reader never sees a manifest naming a missing object. A killed run reruns and
   skips every object already complete.

The S3 client and its typed errors come from ``shards.formats.s3``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from shards.atomic import sha256_file
from shards.errors import CorruptDataError, InputError, MissingInputError, OutputExistsError
from shards.formats.s3 import S3Options, _final_error, head_object, make_client, parse_s3_url, read_object

log = logging.getLogger("shardcache.s3")

MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20
SHA256_META = "sha256"  # stored as x-amz-meta-sha256
_PREFIX_CHARS = re.compile(r"^[A-Za-z0-9!\-_.*'()/]*$")


@dataclass(frozen=True)
class PublishSpec:
    """What kind of output is published: its manifest file, how to tell two outputs of it apart, and which
    object names (relative to the prefix) are its own, so ``--overwrite`` deletes only those."""

    manifest_file: str
    identity: Callable[[Mapping[str, Any]], Any]
    is_own: Callable[[str], bool]


@dataclass(frozen=True)
class UploadStats:
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]
    deleted: tuple[str, ...]
    bytes_uploaded: int

    def to_dict(self) -> dict[str, Any]:
        return {"uploaded": len(self.uploaded), "already_complete": len(self.skipped), "deleted": len(self.deleted),
                "bytes_uploaded": self.bytes_uploaded}


def check_out_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of an ``--out s3://bucket/prefix``; the prefix has no trailing slash."""
    bucket, prefix = parse_s3_url(url)
    prefix = prefix.strip("/")
    if not _PREFIX_CHARS.match(prefix) or any(part in (".", "..") for part in prefix.split("/") if prefix):
        raise InputError(f"--out {url!r}: the key prefix may hold only letters, digits and !-_.*'()/ and no '.' "
                         "or '..' parts")
    return bucket, prefix


def default_stage_dir(url: str, root: str | os.PathLike) -> Path:
    """``root/<first 16 hex of sha256(url)>``: the same URL stages in the same folder, so a rerun resumes."""
    return Path(root) / hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _client_call(url: str, call: Callable[[], Any]) -> Any:
    """One S3 call; a failure becomes the typed error ``shards.formats.s3`` gives it (else ``CorruptDataError``)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 (botocore raises many types; each is mapped or wrapped below)
        final = _final_error(exc, url)
        if final is not None:
            raise final from None
        raise CorruptDataError(f"S3 request failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                               path=url) from None


def list_prefix(client: Any, bucket: str, prefix: str) -> dict[str, int]:
    """Every object under ``prefix/`` (name relative to the prefix -> size)."""
    start = f"{prefix}/" if prefix else ""
    url = f"s3://{bucket}/{start}"
    objects: dict[str, int] = {}
    token = None
    while True:
        kwargs = {"Bucket": bucket, "Prefix": start, **({"ContinuationToken": token} if token else {})}
        page = _client_call(url, lambda kwargs=kwargs: client.list_objects_v2(**kwargs))
        for item in page.get("Contents", []):
            objects[item["Key"][len(start):]] = int(item["Size"])
        if not page.get("IsTruncated"):
            return objects
        token = page["NextContinuationToken"]


def object_state(url: str, options: S3Options | None = None) -> tuple[int, str | None] | None:
    """``(size, recorded sha256)`` of an object, or None when there is none."""
    try:
        size, metadata = head_object(url, options)
    except MissingInputError:
        return None
    return size, metadata.get(SHA256_META)


def upload_file(client: Any, path: Path, bucket: str, key: str, *, size: int, sha256: str,
                options: S3Options | None = None) -> None:
    """Upload ``path`` (multipart above ``MULTIPART_THRESHOLD``) with its sha256 in the metadata, then check it."""
    from boto3.s3.transfer import TransferConfig

    url = f"s3://{bucket}/{key}"
    config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK)
    _client_call(url, lambda: client.upload_file(str(path), bucket, key, Config=config,
                                                 ExtraArgs={"Metadata": {SHA256_META: sha256}}))
    state = object_state(url, options)
    if state != (size, sha256):
        raise CorruptDataError(f"after upload the object holds {state} (size, sha256), expected {(size, sha256)}",
                               path=url)


def _named_files(manifest: Mapping[str, Any]) -> Iterator[tuple[str, int | None, str | None]]:
    """``(name, size, sha256)`` of every file a manifest names (size/sha256 None where it records none)."""
    for split in manifest.get("splits", {}).values():
        for shard in split["shards"]:
            yield shard["path"], int(shard["bytes"]), shard["sha256"]
            if shard.get("index"):
                yield shard["index"], None, shard.get("index_sha256")
    source_index = manifest.get("source_index")
    if isinstance(source_index, Mapping) and source_index.get("path"):
        yield source_index["path"], None, source_index.get("sha256")


def check_prefix(client: Any, url: str, local_manifest: Mapping[str, Any], spec: PublishSpec, *,
                 overwrite: bool, options: S3Options | None = None) -> tuple[dict[str, int], list[str]]:
    """Refuse a prefix holding another dataset or foreign objects (unless ``overwrite``); returns the objects
    under it and, when overwriting, the own objects to delete (the remote manifest first)."""
    bucket, prefix = check_out_url(url)
    objects = list_prefix(client, bucket, prefix)
    foreign = sorted(name for name in objects if not spec.is_own(name))
    if foreign and not overwrite:
        raise OutputExistsError(f"holds objects shardcache did not write ({', '.join(foreign[:3])}); choose another "
                                "prefix or pass --overwrite (which deletes only shardcache's own objects)", path=url)
    different = False
    if spec.manifest_file in objects:
        remote_url = f"s3://{bucket}/{_key(prefix, spec.manifest_file)}"
        try:
            remote = json.loads(read_object(remote_url, options))
            different = spec.identity(remote) != spec.identity(local_manifest)
        except (ValueError, TypeError, KeyError, AttributeError):
            different = True
        if different and not overwrite:
            raise OutputExistsError(f"already holds a different {spec.manifest_file} (other source, options or "
                                    "config); pass --overwrite to replace it", path=url)
    if not overwrite or not (different or foreign):
        return objects, []
    own = sorted((name for name in objects if spec.is_own(name) and name != spec.manifest_file))
    return objects, ([spec.manifest_file] if spec.manifest_file in objects else []) + own


def publish_folder(folder: str | os.PathLike, url: str, spec: PublishSpec, *, options: S3Options | None = None,
                   overwrite: bool = False) -> UploadStats:
    """Upload the finished output in ``folder`` to ``url``: the files its manifest names, then the manifest."""
    folder = Path(folder)
    bucket, prefix = check_out_url(url)
    local_manifest = json.loads((folder / spec.manifest_file).read_text(encoding="utf-8"))
    client = make_client(options)
    objects, to_delete = check_prefix(client, url, local_manifest, spec, overwrite=overwrite, options=options)
    for name in to_delete:  # the manifest first: a reader never sees one naming a deleted object
        key = _key(prefix, name)
        _client_call(f"s3://{bucket}/{key}", lambda key=key: client.delete_object(Bucket=bucket, Key=key))
        objects.pop(name, None)
    uploaded, skipped, sent = [], [], 0
    names = list(_named_files(local_manifest)) + [(spec.manifest_file, None, None)]
    for name, size, sha256 in names:
        path = folder / name
        if size is None:
            size = path.stat().st_size
        if sha256 is None or name == spec.manifest_file:
            sha256 = sha256_file(path)
        elif os.path.getsize(path) != size:
            raise CorruptDataError(f"staged file is {os.path.getsize(path)} bytes, the manifest says {size}",
                                   path=str(path))
        key = _key(prefix, name)
        if name in objects and object_state(f"s3://{bucket}/{key}", options) == (size, sha256):
            skipped.append(name)
            continue
        upload_file(client, path, bucket, key, size=size, sha256=sha256, options=options)
        uploaded.append(name)
        sent += size
        log.info("uploaded %s (%d bytes)", f"s3://{bucket}/{key}", size)
    return UploadStats(tuple(uploaded), tuple(skipped), tuple(to_delete), sent)


__all__ = ["MULTIPART_THRESHOLD", "PublishSpec", "UploadStats", "check_out_url", "check_prefix",
           "default_stage_dir", "list_prefix", "object_state", "publish_folder", "upload_file"]
