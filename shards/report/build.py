"""``shards report``: one self-contained HTML page for datasets, feature caches and training runs.

People look before they read, and share what they look at: the page opens from a cluster's shared file system in
any browser with no network (inline SVG and images, inline CSS, a few lines of script to sort tables). Each folder
given becomes a section, and each section pulls in what it was made from when that is local and readable: a run
its features or dataset (``config.json``'s ``data_path``), a feature cache its dataset (``features.json``'s
``dataset_dir``, followed as ``shards.door.locations.dataset_location`` allows). Every manifest is untrusted:
folders are read through the manifest loaders' checks, shards through the library's reader, and every string is
escaped on its way into the page.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from shards.atomic import write_text_shared
from shards.errors import InputError, MissingInputError, ShardcacheError
from shards.transport.location import locate
from shards.manifest import (DATASET_FILE, FEATURES_FILE, TOOL, DatasetManifest, FeatureManifest, load_manifest,
                             utc_now)
from shards.report.html import GENERATOR_META, Markup, Section, esc, note, page, tag
from shards.report.samples import GridOptions
from shards.runrecord import REPORT_FILE  # a run's, and the default name of any folder's report

KINDS = ("dataset", "features", "run")


@dataclass(frozen=True)
class Report:
    sections: tuple[Section, ...]

    def title(self) -> str:
        if len(self.sections) == 1:
            only = self.sections[0]
            return f"{only.kind} report: {only.title}"
        return "shardcache report"

    def html(self) -> str:
        return page(self.title(), self.sections, utc_now(), TOOL)

    def write(self, out: str | os.PathLike) -> Path:
        """Written atomically: a browser or a colleague reloading mid-write sees the old page or the new one."""
        out = Path(out)
        write_text_shared(out, self.html())
        return out

    def summary(self) -> list[dict[str, str]]:
        return [{"kind": s.kind, "path": s.path, "anchor": s.anchor} for s in self.sections]


def folder_kind(path: str | os.PathLike) -> tuple[Path, str]:
    """The folder ``path`` names (a manifest file names its folder) and what it holds; ``InputError`` if nothing
    a report knows."""
    from shards.runrecord import is_run_folder

    text = str(path)
    if locate(text).local_path() is None:
        raise InputError("is remote; a report reads local folders only (copy the manifests, or mount it)", path=text)
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    if not folder.exists():
        raise MissingInputError("no such folder", path=text)
    if is_run_folder(folder):
        return folder, "run"
    if (folder / FEATURES_FILE).is_file():
        return folder, "features"
    if (folder / DATASET_FILE).is_file():
        return folder, "dataset"
    raise InputError(f"is neither a dataset ({DATASET_FILE}), a feature cache ({FEATURES_FILE}) nor a training run "
                     "(metrics.jsonl + config.json)", path=text)


def _link(kind: str, folder: Path, anchor: str, relation: str) -> Markup:
    return tag("p", esc(f"{relation}: ") + tag("span", kind, class_=f"badge {kind}") + " "
               + tag("a", str(folder), href=f"#{anchor}"), class_="note")


class _Builder:
    """Sections in order, each followed by what it links to; a folder reached twice gets one section."""

    def __init__(self, grid: GridOptions | None):
        self.grid = grid
        self.sources: dict[str, str] = {}  # a dataset folder -> where a run read its shards from (--source)
        self.sections: list[Section | None] = []
        self.anchors: dict[str, str] = {}

    def add(self, path: str | os.PathLike) -> str:
        folder, kind = folder_kind(path)
        key = os.path.realpath(folder)
        if key in self.anchors:
            return self.anchors[key]
        anchor = f"{kind}-{len(self.anchors) + 1}"
        self.anchors[key] = anchor  # before building: a folder that links back to this one finds it
        slot = len(self.sections)
        self.sections.append(None)  # the place of this section, before the ones it links to
        try:
            self.sections[slot] = getattr(self, f"_{kind}")(folder, anchor)
        except BaseException:
            del self.anchors[key]
            raise
        return anchor

    def follow(self, folder: Path | str, relation: str) -> tuple[Markup, Any]:
        """Include a linked folder: the link, and its manifest (None when it could not be included)."""
        try:
            anchor = self.add(folder)
            target, kind = folder_kind(folder)
            manifest = load_manifest(target) if kind != "run" else None
        except (ShardcacheError, OSError, ValueError) as exc:  # a broken neighbour must not cost this section
            return note(f"{relation}: {folder} is not included ({exc}).", "warn"), None
        return _link(kind, target, anchor, relation), manifest

    def _dataset(self, folder: Path, anchor: str) -> Section:
        from shards.report.dataset import dataset_section
        from shards.manifest import load_dataset_manifest

        source = self.sources.get(os.path.realpath(folder))
        grid = self.grid if self.grid is None or source is None else dataclasses.replace(self.grid, source=source)
        return dataset_section(folder, load_dataset_manifest(folder), anchor, grid=grid)

    def _features(self, folder: Path, anchor: str) -> Section:
        from shards.manifest import load_feature_manifest
        from shards.report.features import features_section, freshness

        manifest = load_feature_manifest(folder)
        state = freshness(folder, manifest)
        links = Markup("")
        if state.dataset_dir is not None:
            links = self.follow(state.dataset_dir, "Computed from")[0]
        return features_section(folder, manifest, anchor, state, links=links)

    def _run(self, folder: Path, anchor: str) -> Section:
        from shards.report.run import read_run, run_section, trained_on

        run = read_run(folder)
        links, classes = Markup(""), None
        source = run.config.get("data", {}).get("source") if isinstance(run.config.get("data"), dict) else None
        for data_path in trained_on(run.config):
            if isinstance(source, str):  # the tars of an index (shards index), read where the run read them
                self.sources.setdefault(os.path.realpath(data_path), source)
            if locate(data_path).local_path() is None:
                links += note(f"Trained on {data_path}: remote, not included (a report reads local folders only).")
                continue
            # Relative to where training ran: where write_run_report runs, and usually where one runs the CLI.
            link, manifest = self.follow(data_path, "Trained on")
            links += link
            if classes is None and isinstance(manifest, (DatasetManifest, FeatureManifest)):
                classes = manifest.classes
        mixture = run.config.get("mixture")
        if isinstance(mixture, dict) and isinstance(mixture.get("classes"), list):
            classes = tuple(str(c) for c in mixture["classes"])  # a union class map: the run's own class list
        return run_section(run, anchor, classes=classes, links=links)


def _grid_options(grid: bool | GridOptions) -> GridOptions | None:
    if isinstance(grid, GridOptions):
        return grid
    return GridOptions() if grid else None


def make_report(paths: Sequence[str | os.PathLike] | str | os.PathLike, *, grid: bool | GridOptions = True) -> Report:
    """The report of ``paths`` (each a dataset, feature or run folder) and of the local folders they name."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise InputError("give at least one folder")
    builder = _Builder(_grid_options(grid))
    for path in paths:
        builder.add(path)
    return Report(tuple(s for s in builder.sections if s is not None))


def build_report(paths: Sequence[str | os.PathLike] | str | os.PathLike, *, grid: bool | GridOptions = True) -> str:
    """The HTML text of ``make_report(paths)``."""
    return make_report(paths, grid=grid).html()


def write_report(paths: Sequence[str | os.PathLike] | str | os.PathLike, out: str | os.PathLike, *,
                 grid: bool | GridOptions = True) -> Path:
    return make_report(paths, grid=grid).write(out)


REPORT_SUFFIXES = (".html", ".htm")
_HEAD_BYTES = 4096  # the generator marker sits in the first lines of the head


def check_report_out(out: str | os.PathLike) -> None:
    """Refuse a target a report must not replace, by one rule: it is an ``.html`` file that is absent or a page this
    command wrote (its head carries ``GENERATOR_META``). Every artifact of a known folder (``dataset.json``,
    ``features.json``, what they list, ``.pack/`` records, a run's ``config.json``, ``metrics.jsonl`` and
    checkpoints) is not ``.html``; the one that is, ``report.html``, is a report; a user's own page lacks the marker."""
    path = Path(out)
    if path.suffix.lower() not in REPORT_SUFFIXES:
        raise InputError(f"--out must name an .html file, not {path.name!r}: a report never replaces a manifest, "
                         "record, shard or checkpoint", path=str(out))
    if not os.path.lexists(path):
        return
    if not path.is_file():
        raise InputError("--out exists and is not a regular file; choose another name", path=str(out))
    try:
        with open(path, "rb") as handle:
            head = handle.read(_HEAD_BYTES)
    except OSError as exc:
        raise InputError(f"--out exists and cannot be read ({exc.strerror or exc})", path=str(out)) from None
    if GENERATOR_META.encode("utf-8") not in head:
        raise InputError("--out exists and is not a shardcache report (a page of your own?): a report replaces only "
                         "an earlier report; choose another name or remove the file", path=str(out))


def default_out(paths: Iterable[str | os.PathLike]) -> Path:
    """``PATH/report.html`` for one folder, else ``report.html`` here."""
    paths = list(paths)
    if len(paths) == 1:
        folder = Path(paths[0])
        return (folder.parent if folder.is_file() else folder) / REPORT_FILE
    return Path(REPORT_FILE)


def write_run_report(run_dir: str | os.PathLike, *, grid: bool | GridOptions = True) -> Path:
    """``run_dir/report.html``, written atomically: what ``train-from-shards`` calls as epochs end (at most every 30 s) and at the end.

    The data the run was trained on is included when local; its sample grid is decoded once per process and
    reused while that dataset is unchanged, so later epochs pay only for reading the manifests and metrics."""
    run_dir = Path(run_dir)
    if folder_kind(run_dir)[1] != "run":
        raise InputError("is not a training run folder (no metrics.jsonl or config.json)", path=str(run_dir))
    return write_report([run_dir], run_dir / REPORT_FILE, grid=grid)


__all__ = ["KINDS", "REPORT_FILE", "Report", "build_report", "check_report_out", "default_out", "folder_kind",
           "make_report", "write_report", "write_run_report"]
