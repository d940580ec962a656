"""Publishing a finished local output folder to object storage (``s3://bucket/prefix``), manifest last.

Writers never write to S3 directly: ``pack-shards`` and ``precompute-features`` build their output in a local
staging folder exactly as they would anywhere else (resumable, locked, atomic), then ``publish_folder`` uploads it:

1. It takes the writer's lease on the prefix (``shards.publish.s3_lease``): a second publisher to the same prefix,
   from any stage folder or node, is refused in one line (exit 2) until the first releases it or stops renewing
   it; ``break_lease`` (``--break-lease``) takes a live one over. Every step below runs under the lease.
2. ``check_prefix`` lists the prefix and reads the manifest there, if any, with its ETag. A manifest of a different
   dataset (other plan, config or source), or objects shardcache does not write, are refused (``OutputExistsError``,
   exit 2) unless ``overwrite``; overwriting deletes the old manifest first, then the objects it names, never
   others (``shards.jobs.owned``: an object that merely looks like a shard is not ours). An object this publish would
   write that the old manifest does not name and that no publish wrote (no sha256 metadata: a user's own upload)
   is refused even with ``overwrite``, before anything is written: never replaced.
3. ``abort_stale_uploads`` aborts the unfinished multipart uploads of the keys this publish writes: a run killed
   or cut off mid-upload leaves its parts on the server (billed on AWS until a lifecycle rule removes them), and
   the transfer library aborts only the failures it sees. Other keys' uploads are never touched.
4. Every file the local manifest names (shards, tar indexes, the source index) is uploaded unless the object is
   already complete: same size and the same sha256 in its metadata (``x-amz-meta-sha256``). Above
   ``MULTIPART_THRESHOLD`` boto3 uploads in parts. After each upload a HEAD checks size and sha256 again, and the
   lease is checked: a lost lease stops the run (``LeaseLostError``) before anything more is written. When the
   lease was taken over from another writer (which may still be finishing an upload), every object is checked
   once more before the manifest.
5. The manifest goes last, after renewing the lease, in one ``PUT`` conditional on the manifest read in step 2
   (``If-Match`` its ETag, or ``If-None-Match: *`` when there was none, or when ``overwrite`` deleted it), so a
   writer that lost its lease in the meantime never replaces another writer's manifest (nor one written by a
   writer that takes no lease). A reader never sees a manifest naming a missing object, and a killed run reruns
   and skips every object already complete.

The S3 client, its typed errors and ``client_call`` come from ``shards.transport.s3``; the listing of a prefix is
the location layer's one retried lister (``shards.transport.listing.list_objects``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from shards.atomic import sha256_file
from shards.door.bounded_read import parse_json, read_json_file
from shards.errors import CorruptDataError, InputError, MissingInputError, OutputExistsError
from shards.formats.columns import COLUMNS_KEY, column_file_entries
from shards.door.locations import local_shard_path
from shards.transport.s3 import S3Options, S3PreconditionFailed, client_call, make_client, parse_s3_url
from shards.transport.listing import list_objects
from shards.transport.s3_ranges import head_object, read_object
from shards.publish.s3_lease import LEASE_NAME, Lease, hold_lease
from shards.jobs.owned import plain_names, shown

log = logging.getLogger("shardcache.s3")

MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20
SHA256_META = "sha256"  # stored as x-amz-meta-sha256
_PREFIX_CHARS = re.compile(r"^[A-Za-z0-9!\-_.*'()/]*\Z")


@dataclass(frozen=True)
class PublishSpec:
    """What kind of output is published: its manifest file, how to tell two outputs of it apart, and which
    object names (relative to the prefix) look like its own: a prefix holding any other is refused without
    ``--overwrite``. What ``--overwrite`` deletes is only what the old manifest names (``check_prefix``)."""

    manifest_file: str
    identity: Callable[[Mapping[str, Any]], Any]
    is_own: Callable[[str], bool]


@dataclass(frozen=True)
class UploadStats:
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]
    deleted: tuple[str, ...]
    bytes_uploaded: int
    aborted_uploads: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"uploaded": len(self.uploaded), "already_complete": len(self.skipped), "deleted": len(self.deleted),
                "bytes_uploaded": self.bytes_uploaded, "aborted_multipart": self.aborted_uploads}


@dataclass(frozen=True)
class PrefixState:
    """What ``check_prefix`` found: the objects (name -> size), the own objects to delete (the manifest first)
    and the ETag of the manifest there (None when there is none), which the new manifest's write is conditional on."""

    objects: dict[str, int]
    to_delete: list[str]
    manifest_etag: str | None


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


def _prefix_url(bucket: str, prefix: str) -> str:
    return f"s3://{bucket}/{prefix}/" if prefix else f"s3://{bucket}/"


def list_prefix(url: str, options: S3Options | None = None) -> dict[str, int]:
    """Every object under the prefix ``url`` (name relative to the prefix -> size), whatever its key: a foreign
    object is named, never skipped (the one retried lister, ``shards.transport.listing.list_objects``)."""
    return {name: size for name, size, _, _ in list_objects(url, options)}


def object_state(url: str, options: S3Options | None = None) -> tuple[int, str | None] | None:
    """``(size, recorded sha256)`` of an object, or None when there is none."""
    try:
        size, metadata = head_object(url, options)
    except MissingInputError:
        return None
    return size, metadata.get(SHA256_META)


def upload_file(client: Any, path: Path, bucket: str, key: str, *, size: int, sha256: str,
                options: S3Options | None = None, if_match: str | None = None, if_absent: bool = False) -> None:
    """Upload ``path`` with its sha256 in the metadata, then check it. Unconditional uploads go in parts above
    ``MULTIPART_THRESHOLD``; ``if_match`` (an ETag) or ``if_absent`` make it one conditional ``PUT`` (the manifest),
    which raises ``S3PreconditionFailed`` when the object is no longer what the writer read."""
    from boto3.s3.transfer import TransferConfig

    url = f"s3://{bucket}/{key}"
    if if_match is None and not if_absent:
        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK)
        client_call(url, lambda: client.upload_file(str(path), bucket, key, Config=config,
                                                    ExtraArgs={"Metadata": {SHA256_META: sha256}}))
    else:
        condition = {"IfMatch": if_match} if if_match is not None else {"IfNoneMatch": "*"}
        body = path.read_bytes()
        try:
            client_call(url, lambda: client.put_object(Bucket=bucket, Key=key, Body=body,
                                                       Metadata={SHA256_META: sha256}, **condition))
        except S3PreconditionFailed:
            if object_state(url, options) != (size, sha256):  # else: our own PUT, whose answer was lost
                raise S3PreconditionFailed("changed since this run read it (another writer published here); "
                                           "not replaced", path=url) from None
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
    yield from column_file_entries(manifest.get(COLUMNS_KEY))  # the column index (shards.formats.columns)


def _staged_files(folder: Path, manifest: Mapping[str, Any], manifest_file: str) -> list[tuple[str, int, str]]:
    """``(name, size, sha256)`` of every staged file to publish, the manifest last; a file whose size differs
    from the manifest's record is refused."""
    files = []
    for name, size, sha256 in [*_named_files(manifest), (manifest_file, None, None)]:
        path = folder / name if name == manifest_file else local_shard_path(
            folder, name, where=str(folder / manifest_file), what="file")
        if size is None:
            size = path.stat().st_size
        if sha256 is None or name == manifest_file:
            sha256 = sha256_file(path)
        elif os.path.getsize(path) != size:
            raise CorruptDataError(f"staged file is {os.path.getsize(path)} bytes, the manifest says {size}",
                                   path=str(path))
        files.append((name, size, sha256))
    return files


def foreign_objects(objects: Mapping[str, int], spec: PublishSpec) -> list[str]:
    """The objects under a prefix that shardcache did not write (the writers' lease is its own)."""
    return sorted(name for name in objects if not spec.is_own(name) and name != LEASE_NAME)


def refuse_foreign(objects: Mapping[str, int], spec: PublishSpec, url: str, *, overwrite: bool) -> list[str]:
    """``OutputExistsError`` for objects shardcache did not write, unless ``overwrite``; returns them."""
    foreign = foreign_objects(objects, spec)
    if foreign and not overwrite:
        raise OutputExistsError(f"holds objects shardcache did not write ({shown(foreign)}); choose another "
                                "prefix or pass --overwrite (which deletes only shardcache's own objects)", path=url)
    if foreign:  # any key at all, one unusable as a file name too: left alone, named, the rest proceeds
        log.info("%s: leaving %d object(s) shardcache did not write (%s)", url, len(foreign), shown(foreign))
    return foreign


def abort_stale_uploads(client: Any, bucket: str, prefix: str, names: Iterable[str]) -> int:
    """Abort every unfinished multipart upload of ``prefix/<name>`` for the given names, and only those; called
    under the lease, so each was left by a run that was killed, cut off, or lost its lease. Returns the count."""
    keys = {_key(prefix, name) for name in names}
    start = f"{prefix}/" if prefix else ""
    url = f"s3://{bucket}/{start}"
    stale: list[tuple[str, str]] = []
    markers: dict[str, str] = {}
    while True:
        page = client_call(url, lambda markers=markers: client.list_multipart_uploads(
            Bucket=bucket, Prefix=start, **markers))
        stale += [(item["Key"], item["UploadId"]) for item in page.get("Uploads", []) if item["Key"] in keys]
        if not page.get("IsTruncated"):
            break
        markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
    for key, upload_id in stale:
        try:
            client_call(f"s3://{bucket}/{key}", lambda key=key, upload_id=upload_id: client.abort_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id))
        except MissingInputError:  # NoSuchUpload: completed or aborted since it was listed
            continue
    if stale:
        log.info("aborted %d unfinished multipart upload(s) under %s left by an earlier run", len(stale), url)
    return len(stale)


def _manifest_etag(client: Any, bucket: str, key: str) -> str | None:
    try:
        return client_call(f"s3://{bucket}/{key}", lambda: client.head_object(Bucket=bucket, Key=key))["ETag"]
    except MissingInputError:
        return None


def check_prefix(client: Any, url: str, local_manifest: Mapping[str, Any], spec: PublishSpec, *,
                 overwrite: bool, options: S3Options | None = None) -> PrefixState:
    """Refuse a prefix holding another dataset or foreign objects (unless ``overwrite``); returns the objects
    under it, when overwriting the own objects to delete (the remote manifest first), and the manifest's ETag."""
    bucket, prefix = check_out_url(url)
    objects = list_prefix(_prefix_url(bucket, prefix), options)
    foreign = refuse_foreign(objects, spec, url, overwrite=overwrite)
    different, etag, named = False, None, {spec.manifest_file}
    if spec.manifest_file in objects:
        key = _key(prefix, spec.manifest_file)
        etag = _manifest_etag(client, bucket, key)  # before the read: a change in between fails the final write
        try:
            remote = parse_json(read_object(f"s3://{bucket}/{key}", options))
            different = spec.identity(remote) != spec.identity(local_manifest)
            named |= plain_names(name for name, _, _ in _named_files(remote))
        except (ValueError, TypeError, KeyError, AttributeError):
            different = True  # unreadable: it is replaced, what it may have named stays
        if different and not overwrite:
            raise OutputExistsError(f"already holds a different {spec.manifest_file} (other source, options or "
                                    "config); pass --overwrite to replace it", path=url)
    _refuse_replacing(url, objects, named, [name for name, _, _ in _named_files(local_manifest)], options)
    if not overwrite or not (different or foreign):
        return PrefixState(objects, [], etag)
    own = sorted(name for name in objects if name in named and name != spec.manifest_file)
    return PrefixState(objects, ([spec.manifest_file] if spec.manifest_file in objects else []) + own, etag)


def _refuse_replacing(url: str, objects: Mapping[str, int], named: set[str], writes: Iterable[str],
                      options: S3Options | None) -> None:
    """``OutputExistsError`` for an object this publish would write that the remote manifest does not name and no
    publish wrote (no sha256 metadata): a user's own object, which an upload must not replace. One written by a
    publish that was killed before its manifest carries the metadata, and is skipped or replaced as before."""
    bucket, prefix = check_out_url(url)
    blocking = []
    for name in writes:
        if name in objects and name not in named:
            state = object_state(f"s3://{bucket}/{_key(prefix, name)}", options)
            if state is not None and state[1] is None:
                blocking.append(name)
    if blocking:
        raise OutputExistsError(f"holds {len(blocking)} object(s) that no shardcache publish wrote here but this one "
                                f"would replace ({shown(blocking)}); --overwrite removes only what the old manifest "
                                "names: move them away or choose another prefix", path=url)


def publish_folder(folder: str | os.PathLike, url: str, spec: PublishSpec, *, options: S3Options | None = None,
                   overwrite: bool = False, break_lease: bool = False) -> UploadStats:
    """Upload the finished output in ``folder`` to ``url`` under the writers' lease: the files its manifest
    names, then the manifest (see the module docstring)."""
    folder = Path(folder)
    bucket, prefix = check_out_url(url)
    local_manifest = read_json_file(folder / spec.manifest_file)
    files = _staged_files(folder, local_manifest, spec.manifest_file)
    client = make_client(options)
    with hold_lease(client, url, what=f"publishing {spec.manifest_file}", break_lease=break_lease) as lease:
        state = check_prefix(client, url, local_manifest, spec, overwrite=overwrite, options=options)
        aborted = abort_stale_uploads(client, bucket, prefix, [name for name, _, _ in files])
        for name in state.to_delete:  # the manifest first: a reader never sees one naming a deleted object
            key = _key(prefix, name)
            client_call(f"s3://{bucket}/{key}", lambda key=key: client.delete_object(Bucket=bucket, Key=key))
            state.objects.pop(name, None)
            lease.check()
        uploaded, skipped = _upload_missing(client, folder, bucket, prefix, files[:-1], state.objects, lease, options)
        if lease.taken_over:
            _recheck(bucket, prefix, files[:-1], options)
        lease.renew()  # still ours right now; the conditional write below covers the moment after
        name, size, sha256 = files[-1]
        if name in state.objects and object_state(f"s3://{bucket}/{_key(prefix, name)}", options) == (size, sha256):
            skipped.append(name)
        else:
            etag = None if name in state.to_delete else state.manifest_etag
            upload_file(client, folder / name, bucket, _key(prefix, name), size=size, sha256=sha256, options=options,
                        if_match=etag, if_absent=etag is None)
            uploaded.append(name)
            log.info("uploaded %s (%d bytes)", f"s3://{bucket}/{_key(prefix, name)}", size)
    sent = sum(size for name, size, _ in files if name in uploaded)
    return UploadStats(tuple(uploaded), tuple(skipped), tuple(state.to_delete), sent, aborted)


def _upload_missing(client: Any, folder: Path, bucket: str, prefix: str, files: list[tuple[str, int, str]],
                    objects: Mapping[str, int], lease: Lease, options: S3Options | None) -> tuple[list[str], list[str]]:
    """Upload each file not already complete on the server, checking the lease after each; (uploaded, skipped)."""
    uploaded, skipped = [], []
    for name, size, sha256 in files:
        key = _key(prefix, name)
        if name in objects and object_state(f"s3://{bucket}/{key}", options) == (size, sha256):
            skipped.append(name)
            continue
        upload_file(client, folder / name, bucket, key, size=size, sha256=sha256, options=options)
        uploaded.append(name)
        log.info("uploaded %s (%d bytes)", f"s3://{bucket}/{key}", size)
        lease.check()
    return uploaded, skipped


def _recheck(bucket: str, prefix: str, files: list[tuple[str, int, str]], options: S3Options | None) -> None:
    """After taking over another writer's lease: every object is still what this run uploaded or found."""
    for name, size, sha256 in files:
        url = f"s3://{bucket}/{_key(prefix, name)}"
        if object_state(url, options) != (size, sha256):
            raise CorruptDataError("changed while this run uploaded: the writer whose lease was taken over is still "
                                   "writing; rerun once it has stopped", path=url)


__all__ = ["MULTIPART_THRESHOLD", "PrefixState", "PublishSpec", "UploadStats", "abort_stale_uploads",
           "check_out_url", "check_prefix", "default_stage_dir", "foreign_objects", "list_prefix", "object_state",
           "publish_folder", "refuse_foreign", "upload_file"]
