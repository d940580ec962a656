"""Shard locations: the one place that turns a manifest's shard path into something to open, and refuses escapes.

A manifest is untrusted input (docs/design.md, "Trust model"), so a shard path in it is only ever a *name*: a
relative POSIX path that stays inside the manifest's folder (or under the remote base). Executable or foreign
locations (``pipe:``, ``file:``, ``s3:``, another host) come only from the caller: the path or ``base_url`` given
to ``open_dataset``. Three checks, at three moments:

- ``check_shard_path`` when a manifest is loaded: the name is well formed. An absolute ``http(s)://`` URL is
  accepted only on an origin (``scheme://host[:port]``) in ``url_origins``: the remote manifest's own origin, plus
  any the caller names explicitly.
- ``shard_location`` when the reader turns names into locations: joins them to the base (URL-quoted for an
  ``http(s)`` base, as an object key under an ``s3://bucket/prefix`` base; never onto a ``pipe:`` command).
- ``local_shard_path`` whenever a shard file, or any other file its manifest names or implies (a tar index
  sidecar, the source index), is opened by path: the resolved file (symlinks followed) must lie inside the resolved
  folder. A symlink pointing outside is refused; a symlinked dataset *folder* is fine, as are links that stay
  inside it. The fix is to copy or hard-link the file into the folder.

``check_redirect`` holds the origin rule for every hop of an ``http(s)`` request: a server on an allowed origin
cannot send the reader to another host by answering with a redirect. ``request_origins`` says which origins those
are for a dataset (its remote manifest's own, plus the caller's ``url_origins``); the reader hands them to every
request it makes for the dataset: the manifest, each shard, each node-cache fetch.

``dataset_folder`` reads a feature manifest's ``dataset_dir``: the local folder of the image dataset the features
came from. It is trusted only as far as this: the folder's ``dataset.json`` is read (and checked like any
manifest), and its shards are opened only through that manifest, confined to the folder. A ``dataset_dir`` may also
be an ``s3://bucket/prefix`` URL (features computed from object storage): ``check_dataset_dir`` accepts it only as
such a URL, and ``dataset_location`` follows it only when the features themselves are read from ``s3://`` (the
caller chose object storage and its options for this call) or the caller names the dataset explicitly; it is then
read with the caller's storage options only (a manifest never carries options), and only its ``dataset.json``.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Iterable

from shards.errors import ManifestError

REMOTE_SCHEMES = ("http://", "https://", "s3://", "pipe:")
URL_SCHEMES = ("http", "https")
MAX_NAME_CHARS = 1024
# "pipe:", "http:", "s3:", "file:", "C:" ...: anything that looks like a scheme is not a plain file name.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_remote(location: str) -> bool:
    return str(location).startswith(REMOTE_SCHEMES)


def url_origin(url: str) -> str | None:
    """``scheme://host[:port]`` of an ``http(s)`` URL (lower-cased), else None (``pipe:``, local paths)."""
    parts = urllib.parse.urlsplit(str(url))
    if parts.scheme.lower() not in URL_SCHEMES or not parts.netloc:
        return None
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def _shown(name: str) -> str:
    text = repr(name)  # repr escapes newlines and control characters: the error stays one line
    return text if len(text) <= 200 else text[:197] + "..."


def check_shard_path(name: object, *, where: str | None = None, url_origins: Iterable[str] = (),
                     what: str = "shard") -> str:
    """``name`` if it is a safe shard path, else ``ManifestError`` naming the manifest (``where``) and the path.

    Safe: a relative POSIX name (no leading ``/``, no ``\\``, no empty, ``.`` or ``..`` parts, no control
    characters, no scheme), or an ``http(s)://`` URL on one of ``url_origins``. ``what`` names the kind of file
    in the message (``"source index"``): every file a manifest names is held to the shards' rule.
    """
    def refuse(why: str) -> ManifestError:
        return ManifestError(f"{what} path {_shown(str(name))} {why}", path=where)

    if not isinstance(name, str):
        raise refuse("is not a string")
    if not name or len(name) > MAX_NAME_CHARS:
        raise refuse(f"must be 1 to {MAX_NAME_CHARS} characters")
    if _CONTROL.search(name):
        raise refuse("contains control characters")
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800"): no file system can name it
            raise refuse("is not valid Unicode text") from None
    if _SCHEME.match(name):
        origin = url_origin(name)
        if origin is not None and origin in {o.lower() for o in url_origins}:
            if any(c.isspace() for c in name):
                raise refuse("is a URL containing whitespace")
            return name
        if origin is not None:
            raise refuse(f"is a URL on {origin}, not on the manifest's own origin; shard URLs are followed only "
                         "under the remote manifest's scheme and host (or on origins the caller allows)")
        raise refuse("is not a relative file name (locations such as pipe: or s3: come only from the caller's "
                     "path or base_url, never from a manifest)")
    if "\\" in name:
        raise refuse("contains a backslash; shard paths use '/'")
    if name.startswith("/"):
        raise refuse("is absolute; shard paths are relative to the manifest's folder")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise refuse("has an empty, '.' or '..' part; shard paths must stay inside the manifest's folder")
    return name


_S3_DATASET = re.compile(r"^s3://[A-Za-z0-9][A-Za-z0-9.\-_]{1,254}(/[^\s/]+)*/?\Z")


def check_dataset_dir(recorded: object, *, where: str | None = None) -> str:
    """A feature manifest's ``dataset_dir``: a local folder path (absolute, or relative to the feature folder), or
    an ``s3://bucket/prefix`` URL (no other scheme, no whitespace, no empty, ``.`` or ``..`` key parts)."""
    if not isinstance(recorded, str):
        raise ManifestError("dataset_dir is not a string", path=where)
    if len(recorded) > 4096:
        raise ManifestError("dataset_dir is longer than 4096 characters", path=where)
    if _CONTROL.search(recorded):
        raise ManifestError(f"dataset_dir {_shown(recorded)} contains control characters", path=where)
    if recorded.startswith("s3://"):
        if not _S3_DATASET.match(recorded) or any(part in (".", "..")
                                                  for part in recorded[len("s3://"):].rstrip("/").split("/")):
            raise ManifestError(f"dataset_dir {_shown(recorded)} is not an s3://bucket/prefix URL", path=where)
        return recorded
    if _SCHEME.match(recorded):
        raise ManifestError(f"dataset_dir {_shown(recorded)} must be a local folder or an s3://bucket/prefix URL, "
                            "not another URL or a command", path=where)
    return recorded


def dataset_folder(feature_folder: str | os.PathLike, recorded: str) -> Path:
    """Where a feature folder's source dataset is: ``dataset_dir`` as recorded, relative to the feature folder.
    Local datasets only; ``dataset_location`` also handles ``s3://`` ones."""
    path = Path(recorded)
    return path if path.is_absolute() else Path(feature_folder) / path


def dataset_location(feature_folder: str | os.PathLike, recorded: str,
                     explicit: str | os.PathLike | None = None) -> tuple[str | Path | None, str | None]:
    """``(where the source dataset is, None)``, or ``(None, why it is not followed)``.

    ``explicit`` (the caller's own dataset location) wins. A recorded ``s3://`` URL is followed only when the
    feature folder is itself on ``s3://`` in the same bucket; a feature folder on ``s3://`` never leads to a local
    path (a downloaded manifest does not pick files on this machine)."""
    if explicit is not None:
        text = str(explicit)
        return (text.rstrip("/") if text.startswith("s3://") else Path(text)), None
    recorded = check_dataset_dir(recorded)
    features_remote = str(feature_folder).startswith("s3://")
    if recorded.startswith("s3://"):
        if not features_remote:
            return None, (f"the dataset it was computed from is on object storage ({recorded}); a local "
                          "features.json's URL is not followed, name the dataset explicitly to check it")
        if _bucket(recorded) != _bucket(str(feature_folder)):
            return None, (f"its dataset_dir {_shown(recorded)} is in another bucket than the features; name the "
                          "dataset explicitly to check it")
        return recorded.rstrip("/"), None
    if features_remote:
        return None, (f"its dataset_dir {_shown(recorded)} is a local path, not followed from object storage; name "
                      "the dataset explicitly to check it")
    return dataset_folder(feature_folder, recorded), None


def _bucket(url: str) -> str:
    return url[len("s3://"):].split("/", 1)[0]


def local_shard_path(folder: str | os.PathLike, name: str, *, where: str | None = None,
                     what: str = "shard") -> Path:
    """``folder / name``, refused unless the file it resolves to (symlinks followed) lies inside ``folder``.

    The one confinement rule for every file a manifest names or implies: shards, tar index sidecars, the source
    index (``what`` names which in the message)."""
    path = Path(folder) / check_shard_path(name, where=where if where is not None else str(folder), what=what)
    root = os.path.realpath(folder)
    target = os.path.realpath(path)
    if os.path.commonpath([root, target]) != root:
        raise ManifestError(
            f"{what} {_shown(name)} resolves to {target}, outside the dataset folder {root} (a symlink?); "
            "copy or hard-link the file into the folder (a symlinked dataset folder is fine)",
            path=where if where is not None else str(path))
    return path


def check_redirect(url: str, target: str, origins: Iterable[str]) -> None:
    """Refuse (``ManifestError`` naming ``url`` and ``target``) a redirect from ``url`` to a ``target`` that is not
    on one of ``origins``: the origin rule holds for every hop, not only for the URL a manifest names."""
    allowed = sorted({o.lower() for o in origins})
    if url_origin(target) not in allowed:
        raise ManifestError(
            f"redirected to {_shown(target)}, not on an allowed origin ({', '.join(allowed)}); dataset URLs are "
            "followed only on the manifest's own origin or those in Remote(url_origins=...)", path=url)


def request_origins(manifests: Iterable[str | os.PathLike], url_origins: Iterable[str] = ()) -> tuple[str, ...]:
    """The origins every hop of a dataset's ``http(s)`` requests may reach: the own origin of each manifest in
    ``manifests`` that is an ``http(s)`` URL (the sources of one ``open_dataset`` call), then the caller's
    ``url_origins``; lower-cased, each once. A request's own URL's origin is allowed besides (``remote.open_url``)."""
    found = [url_origin(str(m)) for m in manifests] + [str(o).lower() for o in url_origins]
    return tuple(dict.fromkeys(o for o in found if o))


def shard_location(base: str, name: str, *, where: str | None = None, what: str = "shard") -> str:
    """Where shard ``name`` (or another file its manifest names: ``what``) is, given the base its manifest (or the
    caller's ``base_url``) sets.

    ``name`` was checked when its manifest was loaded; an ``http(s)`` URL there stays as it is. Relative names go
    under a remote base (percent-quoted, so ``?`` or ``#`` cannot change the URL's meaning) or into a local
    folder (confined, see ``local_shard_path``). Whatever the manifest says, it never becomes a ``pipe:``.
    """
    base = str(base)
    if _SCHEME.match(name):
        if url_origin(name) is None:
            raise ManifestError(f"{what} path {_shown(name)} is not a relative file name", path=where)
        return name
    if base.startswith("pipe:"):
        raise ManifestError(f"a pipe: location cannot hold relative {what} paths", path=base)
    if base.startswith("s3://"):  # an object key, not a URL path: nothing to quote
        return base.rstrip("/") + "/" + check_shard_path(name, where=where, what=what)
    if is_remote(base):
        return base.rstrip("/") + "/" + urllib.parse.quote(check_shard_path(name, where=where, what=what), safe="/")
    return str(local_shard_path(base, name, where=where, what=what))
