"""A wids shard index for one split of a dataset: webdataset's random-access reader opens our tar shards without us.

wids (``wids.ShardListDataset``, from the ``wids`` package; the webdataset wheel no longer carries it) opens a JSON
description, ``{"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": [{"url", "nsamples",
"filesize"}, ...]}``, and maps sample ``i`` to a shard by the running sum of ``nsamples``. Our tar shards already
follow its grouping rule (webdataset's: the key is a member's name before the first dot of its last path part), so
the manifest's per-shard counts are exactly what wids counts, and no shard needs to be read.

Urls are relative to the index file by default: wids resolves a relative url against the folder the index was
loaded from, so the index and the dataset can move together. ``url_base`` writes ``url_base/<shard name>``
instead; a dataset on ``s3://`` or ``http(s)://`` is written with its own absolute urls unless given one.

The manifest is untrusted and wids hands some urls to a shell (``curl '{url}'``, ``aws s3 cp '{url}'``) and others
to ``urlparse``: a url that one of them would read differently (a quote, or ``?``, ``#``, ``;`` in a path) is
refused, naming the shard, rather than written. The index is written atomically and never replaces a file that is
not an earlier wids index, nor that one without ``overwrite``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import urlparse, urlunparse

from shards.atomic import check_local_output, write_json_atomic
from shards.door.bounded_read import read_json_file
from shards.errors import InputError, OutputExistsError, ShardcacheError
from shards.manifest import DATASET_FILE, FEATURES_FILE, TOOL, DatasetManifest, ShardInfo
from shards.transport.location import Location, locate
from shards.transport.manifest_io import load_manifest_at

WIDS_KIND = "wids-shard-index-v1"
WIDS_VERSION = 1
_LOCAL_UNSAFE = "?#;"  # urlparse would read these as query, fragment or params, not as part of the file's path


_REFUSED = {
    "hdf5": "has hdf5 shards: wids reads tar shards only (pack with --storage tar)",
    # An adopted index's rows may leave out samples shardcache refused and carry labels the tars do not: wids would
    # read every sample of each tar, numbered differently. Its tars are WebDataset shards already.
    "wds": "is an adopted WebDataset index (shards index): wids reads the source tars themselves, and its rows may "
           "leave out samples shardcache refused; index the source tars with wids's own tools",
}


@dataclass(frozen=True)
class WidsExport:
    """What ``export_wids_index`` wrote: where, for which split, and whether its urls are relative to it."""

    out: str
    split: str
    shards: int
    samples: int
    bytes: int
    relative_urls: bool

    def to_dict(self) -> dict[str, Any]:
        return {"out": self.out, "split": self.split, "shards": self.shards, "samples": self.samples,
                "bytes": self.bytes, "relative_urls": self.relative_urls}


def export_wids_index(dataset: str | os.PathLike, split: str, out: str | os.PathLike, *,
                      url_base: str | None = None, overwrite: bool = False, storage_options: Any = None,
                      url_origins: Iterable[str] = ()) -> WidsExport:
    """Write the wids index of ``split`` of the dataset at ``dataset`` (a folder, ``dataset.json``, ``s3://`` or
    ``http(s)://`` prefix) to the local file ``out``. ``url_base``: where the shards will be read from (a folder,
    ``s3://``, ``https://``), else relative to ``out`` for a local dataset and the dataset's own urls otherwise."""
    check_out(out, overwrite=overwrite)
    if url_base is not None:
        check_url_base(url_base)
    manifest, base = load_manifest_at(dataset, url_origins=url_origins, storage_options=storage_options)
    where = f"{base.rstrip('/')}/{DATASET_FILE}"
    if not isinstance(manifest, DatasetManifest):
        raise InputError(f"holds {FEATURES_FILE}, a feature cache: a wids index lists image tar shards",
                         path=str(dataset))
    if manifest.storage != "tar":
        raise InputError(_REFUSED.get(manifest.storage, f"has {manifest.storage} shards: wids reads tar shards only"),
                         path=where)
    shards = manifest.split(split, where=where).shards
    if not shards:
        raise InputError(f"split {split!r} has no shards: a wids index needs at least one", path=where)
    folder = locate(base, storage_options=storage_options)
    urls = shard_urls(folder, shards, out=out, url_base=url_base, where=where)
    relative = not any(_wids_scheme(url) or url.startswith("/") for url in urls)
    index = wids_index(shards, urls, name=_dataset_name(folder.text, split), split=split, classes=manifest.classes)
    write_json_atomic(out, index)
    return WidsExport(out=os.fspath(out), split=split, shards=len(shards), samples=sum(s.samples for s in shards),
                      bytes=sum(s.bytes for s in shards), relative_urls=relative)


def wids_index(shards: Sequence[ShardInfo], urls: Sequence[str], *, name: str, split: str,
               classes: Sequence[str]) -> dict[str, Any]:
    """The index itself: wids reads ``url``, ``nsamples`` (and ``filesize``); the rest is for people and tools."""
    return {
        "__kind__": WIDS_KIND,
        "wids_version": WIDS_VERSION,
        "name": name,
        "shardlist": [{"url": url, "nsamples": shard.samples, "filesize": shard.bytes, "sha256": shard.sha256}
                      for shard, url in zip(shards, urls, strict=True)],
        "shardcache": {"split": split, "classes": list(classes), "tool": TOOL},
    }


def shard_urls(folder: Location, shards: Sequence[ShardInfo], *, out: str | os.PathLike, url_base: str | None,
               where: str) -> list[str]:
    """Each shard's url as the index will hold it, checked to mean to wids what it means to us."""
    index_dir = os.path.dirname(os.path.abspath(os.fspath(out)))
    urls = []
    for shard in shards:
        if locate(shard.path).local_path() is None:  # an http(s) URL the manifest named on an allowed origin
            url = shard.path
        elif url_base is not None:
            url = _joined(url_base, shard.path)
        else:
            location = folder.child(shard.path, where=where)
            if location.local_path() is not None:
                location.check_image_shard(None)
                url = _relative(os.path.relpath(os.path.abspath(location.text), index_dir))
            else:
                url = location.text
        _check_url(url, shard.path, where)
        urls.append(url)
    return urls


def _joined(base: str, name: str) -> str:
    folder = locate(base)
    if folder.local_path() is None:  # http(s): the name percent-quoted, as every reader of ours joins it
        return folder.child(name).text
    return base.rstrip("/") + "/" + name  # a folder wherever wids runs, maybe not here: joined, not resolved


def _wids_scheme(url: str) -> str:
    """The scheme wids's ``urlparse`` reads in ``url`` ("" for a path): what it will open the url with."""
    return urlparse(url).scheme


def _relative(path: str) -> str:
    """A relative path as a url: POSIX separators, and ``./`` where ``urlparse`` would take a leading ``x:`` for a
    scheme."""
    url = path.replace(os.sep, "/")
    return f"./{url}" if _wids_scheme(url) else url


def _check_url(url: str, name: str, where: str) -> None:
    def refuse(why: str) -> InputError:
        return InputError(f"shard {name!r}: its wids url {url!r} {why}; rename the shard or choose another "
                          "--url-base", path=where)

    if "'" in url:
        raise refuse("contains a quote, and wids passes urls to a shell in single quotes")
    if not _wids_scheme(url):
        bad = sorted({c for c in url if c in _LOCAL_UNSAFE})
        if bad:
            raise refuse(f"contains {''.join(bad)!r}, which wids would not read as part of a file name")
    elif urlunparse(urlparse(url)) != url:
        raise refuse("does not survive wids's url parsing unchanged")


def check_url_base(url_base: str) -> None:
    if not url_base or not locate(url_base).addressable:
        raise InputError(f"--url-base {url_base!r}: give a folder or a URL prefix (wids would run a pipe: url as a "
                         "command)")


def check_out(out: str | os.PathLike, *, overwrite: bool) -> None:
    """Before any work: ``out`` is a local ``.json`` file that is absent, or (with ``overwrite``) an earlier wids
    index; a manifest or any other file of yours is never replaced."""
    check_local_output(out)
    path = Path(out)
    if path.suffix.lower() != ".json" or path.name in (DATASET_FILE, FEATURES_FILE):
        raise InputError("--out must name a .json file other than a manifest (dataset.json, features.json)",
                         path=str(out))
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise OutputExistsError("exists; pass --overwrite to replace it", path=str(out))
    try:
        earlier = read_json_file(path, follow_symlinks=False)
    except ShardcacheError:
        earlier = None
    if not (isinstance(earlier, dict) and "wids_version" in earlier and "shardlist" in earlier):
        raise OutputExistsError("exists and is not a wids index (a file of yours?): --overwrite replaces only an "
                                "earlier index; choose another name", path=str(out))


def _dataset_name(folder: str, split: str) -> str:
    """wids names its cache by the index's ``name``: the dataset folder's name and the split tell two apart."""
    return f"{folder.rstrip('/').rsplit('/', 1)[-1] or 'dataset'}-{split}"
