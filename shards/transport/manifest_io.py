"""Reading manifests from any location: the one loader of ``dataset.json`` and ``features.json`` for every stage.

The manifests themselves (their fields, their checks) are ``shards.manifest``; this module finds and reads them
wherever a dataset is (``shards.transport.location``), under the trust model (docs/design.md, section 6):

- ``load_manifest_at``: a folder, prefix or URL (or a manifest file itself) -> its manifest and the base its shard
  names are relative to. On this machine ``shards.manifest.load_manifest`` decides which of the two a folder holds;
  under a URL or prefix ``dataset.json`` is asked for, then ``features.json``. Shard URLs in a remote manifest are
  followed only on its own origin and the caller's ``url_origins``, and every redirect of the manifest's own
  request is held to the same (``shards.door.locations.request_origins``); under ``s3://`` a manifest may name
  only relative shard names (an ``s3:`` URL has no origin, so ``check_shard_path`` refuses it).
- ``read_dataset_manifest``: a dataset's ``dataset.json`` and the sha256 of its bytes, from one read, so the
  manifest and the digest a feature cache is tied to always come from the same bytes.
- ``read_feature_manifest``: a feature folder's ``features.json``; ``dataset_sha256_at``: only a dataset's digest.

Every file is read whole within the bounded-read limits, by the caller's means (storage options, origins) only.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

from shards.errors import MissingInputError
from shards.transport.location import Location, locate
from shards.door.locations import request_origins
from shards.manifest import DATASET_FILE, FEATURES_FILE, DatasetManifest, FeatureManifest, Manifest, load_manifest

PathLike = str | os.PathLike | Location


def load_manifest_at(path: PathLike, url_origins: Sequence[str] = (), storage_options: Any = None
                     ) -> tuple[Manifest, str]:
    """The manifest at ``path`` and the base its shard paths are relative to (``storage_options``: how to reach
    ``s3://``; ``url_origins``: the caller's opt-in to shard URLs and redirects on those origins)."""
    where = locate(path, storage_options=storage_options)
    folder = where.local_path()
    if folder is not None:  # a folder or a manifest file on this machine: shards.manifest says which it holds
        manifest = load_manifest(folder, url_origins=url_origins)
        return manifest, str(folder.parent if folder.is_file() else folder)
    origins = request_origins([where.text], url_origins)
    where = locate(where.text, storage_options=where.storage_options, origins=origins)
    files = [where] if where.text.endswith(".json") else [where.file(name) for name in (DATASET_FILE, FEATURES_FILE)]
    for file in files:
        try:
            data = file.read_json()
        except MissingInputError:
            if len(files) == 1:
                raise
            if file is files[-1]:
                names = " or ".join(f.text.rsplit("/", 1)[1] for f in files)
                raise MissingInputError(f"not found (HTTP 404): no {names} under this prefix", path=where.text) \
                    from None
            continue
        kind = FeatureManifest if file.text.endswith(FEATURES_FILE) else DatasetManifest
        return kind.from_dict(data, where=file.text, url_origins=origins), file.parent.text
    raise AssertionError("unreachable")


def read_dataset_manifest(folder: PathLike, storage_options: Any = None) -> tuple[DatasetManifest, str]:
    """The ``dataset.json`` in ``folder`` (a local folder or an ``s3://`` prefix) and the sha256 of its bytes.
    Shard paths in it must be relative names (no URLs, no ``pipe:``)."""
    file = locate(folder, storage_options=storage_options).file(DATASET_FILE)
    payload = file.read_capped()
    return DatasetManifest.from_dict(file.json_of(payload), where=file.text), hashlib.sha256(payload).hexdigest()


def read_feature_manifest(folder: PathLike, storage_options: Any = None) -> FeatureManifest:
    """The ``features.json`` in ``folder`` (a local folder or an ``s3://`` prefix)."""
    file = locate(folder, storage_options=storage_options).file(FEATURES_FILE)
    return FeatureManifest.from_dict(file.read_json(), where=file.text)


def dataset_sha256_at(folder: PathLike, storage_options: Any = None) -> str:
    """The sha256 of the ``dataset.json`` bytes in a local folder or under an ``s3://`` prefix."""
    return hashlib.sha256(locate(folder, storage_options=storage_options).file(DATASET_FILE).read_capped()).hexdigest()
