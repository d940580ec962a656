"""Round two of the location rules, written as an attacker would: what a dataset names is followed nowhere else.

- A server on the manifest's own origin answers a shard, manifest or index request with a redirect to another
  host: refused before the other host sees a request (every hop is held to the origin rule). A host the caller
  lists in ``Remote(url_origins=...)`` is reached on every hop of every request for the dataset (manifest, shard,
  node-cache fetch, DataLoader worker), and no other host through it.
- ``source-index.jsonl`` or a tar index sidecar is a symlink out of the dataset folder: refused like such a
  shard, with one line naming it, before it is read.
- A node-cache copy is changed in place with its size and mtime kept: the first process to use it rehashes it,
  drops it with a warning naming the shard, and reads the shard's true bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import logging
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import shards
from preprocess.pack.source_diff import read_index
from preprocess.pack.packer import PackConfig, pack_manifest
from shards.check.verify import verify_dataset
from shards.cli.main import main as shards_cli
from shards.errors import CorruptDataError, ManifestError
from shards.transport.remote import MAX_REDIRECTS, open_url
from shards.formats.tarindex import load_local_index
from shards.manifest import load_dataset_manifest
from shards.select.mixture import Subset
from shards.order.plan import ShardSlice
from tests.helpers import make_shard_dataset, write_image_folder
from tests.security.test_manifest_locations import one_line_error
from train.cli import train_command

SHARD = "/train-000000.tar"
PASSWD = "root:x:0:0:root:/root:/bin/bash\n"


# -- two loopback servers: the dataset's origin, and a foreign host ------------------------------------------------
class Server:
    """A static file server on 127.0.0.1 that logs every request path and answers the paths in ``redirects``
    with ``(status, Location)``."""

    def __init__(self, folder: Path):
        self.requests: list[str] = []
        self.redirects: dict[str, tuple[int, str]] = {}
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(folder), **kwargs)

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append(self.path)
                if self.path in outer.redirects:
                    status, target = outer.redirects[self.path]
                    self.send_response(status)
                    self.send_header("Location", target)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                super().do_GET()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers(tmp_path: Path):
    """``(origin, foreign, folder)``: both serve the same dataset, so a followed redirect would succeed."""
    folder = tmp_path / "served"
    make_shard_dataset(folder, shard_sizes={"train": [3, 3]}, size=(16, 16))
    (folder / "moved").mkdir()
    shutil.copy(folder / SHARD[1:], folder / "moved" / SHARD[1:])
    origin, foreign = Server(folder), Server(folder)
    yield origin, foreign, folder
    origin.close()
    foreign.close()


def keys(dataset) -> list[str]:
    return [key for _, _, key in dataset]


def local_keys(folder: Path) -> list[str]:
    return keys(shards.open_dataset(folder, return_keys=True, sampling=shards.Sampling(shuffle=False)))


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_shard_redirected_to_another_host_is_refused_before_it_is_asked(servers, status: int):
    origin, foreign, _ = servers
    origin.redirects[SHARD] = (status, f"{foreign.url}{SHARD}")
    for errors in (shards.ErrorPolicy(), shards.ErrorPolicy(on_error="skip")):  # a refusal is never skipped
        dataset = shards.open_dataset(origin.url, errors=errors, sampling=shards.Sampling(shuffle=False))
        with pytest.raises(ManifestError, match="not on an allowed origin") as caught:
            list(dataset)
        message = str(caught.value)
        assert f"{origin.url}{SHARD}" in message and f"{foreign.url}{SHARD}" in message and "\n" not in message
    assert foreign.requests == []


def test_a_redirect_through_the_node_cache_is_refused_and_caches_nothing(servers, tmp_path: Path):
    origin, foreign, folder = servers
    origin.redirects[SHARD] = (302, f"{foreign.url}{SHARD}")
    dataset = shards.open_dataset(origin.url, sampling=shards.Sampling(shuffle=False),
                                  remote=shards.Remote(shard_cache=shards.ShardCache(dir=tmp_path / "cache")))
    with pytest.raises(ManifestError, match="not on an allowed origin"):
        list(dataset)
    assert foreign.requests == []
    redirected = load_dataset_manifest(folder).splits["train"].shards[0].sha256
    assert list((tmp_path / "cache" / "v1").glob(f"??/{redirected}*")) == []


def test_a_redirected_manifest_is_refused(servers):
    origin, foreign, _ = servers
    origin.redirects["/dataset.json"] = (301, f"{foreign.url}/dataset.json")
    with pytest.raises(ManifestError, match="dataset.json"):
        shards.open_dataset(origin.url)
    assert foreign.requests == []


@pytest.mark.parametrize("target", [
    "http://localhost:{port}/train-000000.tar",  # the same server under another name: another origin
    "https://127.0.0.1:{port}/train-000000.tar",  # another scheme
    "file:///etc/passwd",
    "ftp://127.0.0.1/train-000000.tar",
])
def test_every_other_origin_is_refused_whatever_the_scheme(servers, target: str):
    origin, _, _ = servers
    port = origin.url.rsplit(":", 1)[1]
    origin.redirects[SHARD] = (302, target.format(port=port))
    with pytest.raises(ManifestError, match="not on an allowed origin") as caught:
        list(shards.open_dataset(origin.url, sampling=shards.Sampling(shuffle=False)))
    assert target.format(port=port) in str(caught.value)
    assert origin.requests.count(SHARD) == 1  # and the target was never requested on this server either


def test_redirects_within_the_origin_still_work(servers):
    origin, foreign, folder = servers
    origin.redirects[SHARD] = (301, f"{origin.url}/hop")  # absolute, then relative
    origin.redirects["/hop"] = (307, f"/moved{SHARD}")
    in_order = shards.Sampling(shuffle=False)
    assert keys(shards.open_dataset(origin.url, return_keys=True, sampling=in_order)) == local_keys(folder)
    assert f"/moved{SHARD}" in origin.requests and foreign.requests == []


def test_redirects_stop_after_a_few_hops(servers):
    origin, _, _ = servers
    origin.redirects[SHARD] = (302, "/hop-1")
    for hop in range(1, 20):
        origin.redirects[f"/hop-{hop}"] = (302, f"/hop-{hop + 1}")
    with pytest.raises(CorruptDataError, match="redirect not followed") as caught:
        list(shards.open_dataset(origin.url, sampling=shards.Sampling(shuffle=False)))
    assert "\n" not in str(caught.value)
    assert len([path for path in origin.requests if path.startswith("/hop-")]) == MAX_REDIRECTS


def test_another_origin_only_with_the_callers_opt_in(servers):
    origin, foreign, _ = servers
    origin.redirects[SHARD] = (302, f"{foreign.url}{SHARD}")
    with pytest.raises(ManifestError):
        open_url(f"{origin.url}{SHARD}").__enter__()
    assert foreign.requests == []
    with open_url(f"{origin.url}{SHARD}", origins=[foreign.url]) as stream:
        assert stream.read() == (servers[2] / SHARD[1:]).read_bytes()
    assert foreign.requests == [SHARD]


# -- a host the caller lists: followed on every hop of every request for the dataset, and no other ---------------
@pytest.fixture
def mirror(servers):
    """A third server with the same files: the host the caller lists in ``Remote(url_origins=...)``."""
    server = Server(servers[2])
    yield server
    server.close()


def read_through(how: str, url: str, tmp_path: Path, **options) -> list[str]:
    """The keys of ``url``'s train split read directly, through the node cache, or by a pickled copy of the dataset
    (what a DataLoader worker started with ``spawn`` gets)."""
    if how == "cache":
        remote = options.get("remote", shards.Remote())
        options["remote"] = dataclasses.replace(remote, shard_cache=shards.ShardCache(tmp_path / "cache"))
    dataset = shards.open_dataset(url, return_keys=True, **options, sampling=shards.Sampling(shuffle=False))
    return keys(pickle.loads(pickle.dumps(dataset)) if how == "worker" else dataset)


@pytest.mark.parametrize("how", ["direct", "cache", "worker"])
def test_a_shard_redirected_to_a_listed_origin_is_followed(servers, mirror, tmp_path: Path, how: str):
    origin, foreign, folder = servers
    origin.redirects[SHARD] = (302, f"{mirror.url}/moved{SHARD}")
    listed = shards.Remote(url_origins=[mirror.url])
    assert read_through(how, origin.url, tmp_path, remote=listed) == local_keys(folder)
    assert mirror.requests == [f"/moved{SHARD}"] and foreign.requests == []
    with pytest.raises(ManifestError, match="not on an allowed origin"):  # the listing is the caller's, per call
        read_through(how, origin.url, tmp_path / "unlisted")
    assert mirror.requests == [f"/moved{SHARD}"]


@pytest.mark.parametrize("how", ["direct", "cache", "worker"])
@pytest.mark.parametrize("through_mirror", [False, True])
@pytest.mark.slow
def test_listing_an_origin_lets_no_other_host_in(servers, mirror, tmp_path: Path, how: str, through_mirror: bool):
    origin, foreign, _ = servers
    if through_mirror:  # the listed host passes the reader on: its answer is held to the same rule
        origin.redirects[SHARD] = (302, f"{mirror.url}/hop")
        mirror.redirects["/hop"] = (307, f"{foreign.url}{SHARD}")
    else:
        origin.redirects[SHARD] = (302, f"{foreign.url}{SHARD}")
    with pytest.raises(ManifestError, match="not on an allowed origin") as caught:
        read_through(how, origin.url, tmp_path, remote=shards.Remote(url_origins=[mirror.url]))
    message = str(caught.value)
    assert f"{foreign.url}{SHARD}" in message and mirror.url in message and "\n" not in message
    assert foreign.requests == []
    assert mirror.requests == (["/hop"] if through_mirror else [])


def test_a_manifest_redirected_to_a_listed_origin_is_followed(servers, mirror):
    origin, foreign, folder = servers
    origin.redirects["/dataset.json"] = (301, f"{mirror.url}/dataset.json")
    dataset = shards.open_dataset(origin.url, return_keys=True, remote=shards.Remote(url_origins=[mirror.url]),
                                  sampling=shards.Sampling(shuffle=False))
    assert keys(dataset) == local_keys(folder)
    assert mirror.requests == ["/dataset.json"] and foreign.requests == []


@pytest.mark.parametrize("how", ["direct", "cache"])
def test_a_listed_hosts_redirect_back_to_the_manifests_origin_is_followed(servers, mirror, tmp_path: Path,
                                                                          how: str):
    """The manifest names a shard by URL on the listed host, which sends it home: the manifest's own origin holds
    on every hop of every request for the dataset, not only of the requests to it."""
    origin, foreign, folder = servers
    expected = local_keys(folder)
    manifest = json.loads((folder / "dataset.json").read_text())
    manifest["splits"]["train"]["shards"][0]["path"] = f"{mirror.url}{SHARD}"
    (folder / "dataset.json").write_text(json.dumps(manifest))
    mirror.redirects[SHARD] = (302, f"{origin.url}/moved{SHARD}")
    assert read_through(how, origin.url, tmp_path, remote=shards.Remote(url_origins=[mirror.url])) == expected
    assert mirror.requests == [SHARD] and f"/moved{SHARD}" in origin.requests and foreign.requests == []


# -- files a manifest implies: the source index and tar index sidecars ---------------------------------------------
@pytest.fixture(scope="module")
def packed_once(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packed")
    tree = write_image_folder(root / "src", ["cat", "dog"], per_class=6, size=(20, 16))
    pack_manifest(PackConfig(str(tree), str(root / "out"), max_samples=4, val_fraction=0.25, seed=1, quiet=True))
    return root / "out"


@pytest.fixture
def packed(packed_once: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    shutil.copytree(packed_once, folder)
    return folder


def set_source_index(folder: Path, **fields) -> None:
    manifest = json.loads((folder / "dataset.json").read_text())
    manifest["source_index"].update(fields)
    (folder / "dataset.json").write_text(json.dumps(manifest))


def without_columns(folder: Path) -> None:
    """As packed before the column index: a subset then reads the source index (a dataset with columns never
    reads it to select)."""
    manifest = json.loads((folder / "dataset.json").read_text())
    del manifest["columns"]
    (folder / "dataset.json").write_text(json.dumps(manifest))


def test_a_source_index_symlinked_outside_is_refused_not_read(packed: Path, tmp_path: Path):
    # The attacker's link points at another dataset's valid index, with its checksum in dataset.json: before
    # this rule it was read and trusted.
    outside = tmp_path / "elsewhere" / "source-index.jsonl"
    without_columns(packed)
    outside.parent.mkdir()
    shutil.move(packed / "source-index.jsonl", outside)
    (packed / "source-index.jsonl").symlink_to(outside)
    set_source_index(packed, sha256=hashlib.sha256(outside.read_bytes()).hexdigest())
    where = Subset(where="width > 0")
    with pytest.raises(ManifestError, match="outside the dataset folder") as caught:
        shards.open_dataset(shards.SourceSpec(packed, subset=where), "train")
    message = str(caught.value)
    assert "source index 'source-index.jsonl'" in message and str(outside) in message and "\n" not in message

    inspect = CliRunner().invoke(shards_cli, ["inspect", str(packed), "--where", "width > 0", "--quiet"])
    one_line_error(inspect, 2, "source-index.jsonl", str(outside))
    train = CliRunner().invoke(train_command, [str(packed), "--out", str(tmp_path / "run"), "--where", "width > 0",
                                               "--dry-run", "--quiet", "--device", "cpu", "--batch-size", "2"])
    one_line_error(train, 2, "source-index.jsonl", "outside the dataset folder")
    with pytest.raises(ManifestError, match="outside the dataset folder"):
        read_index(packed, load_dataset_manifest(packed))  # pack-shards --append reads it too
    report = verify_dataset(packed)  # reported like a shard symlinked out, never read
    assert len(report.problems) == 1 and "source-index.jsonl" in report.problems[0] \
        and str(outside) in report.problems[0]


def test_a_source_index_linked_to_etc_passwd_is_refused(packed: Path, tmp_path: Path):
    passwd = tmp_path / "passwd"  # stands in for /etc/passwd
    passwd.write_text(PASSWD)
    without_columns(packed)
    (packed / "source-index.jsonl").unlink()
    (packed / "source-index.jsonl").symlink_to(passwd)
    classes = CliRunner().invoke(shards_cli, ["inspect", str(packed), "--classes", "cat", "--where", "width > 0",
                                              "--quiet"])
    one_line_error(classes, 2, "source index", str(passwd))


@pytest.mark.parametrize("name, why", [
    ("../elsewhere/source-index.jsonl", "'..' part"),
    ("/etc/passwd", "is absolute"),
    ("file:///etc/passwd", "not a relative file name"),
])
def test_a_source_index_named_outside_is_refused(packed: Path, name: str, why: str):
    without_columns(packed)
    set_source_index(packed, path=name)
    with pytest.raises(ManifestError, match=why) as caught:
        shards.open_dataset(shards.SourceSpec(packed, subset=Subset(where="width > 0")), "train")
    assert f"source index path {name!r}" in str(caught.value)


def test_a_source_index_in_a_subfolder_or_linked_inside_is_fine(packed: Path):
    (packed / "meta").mkdir()
    shutil.move(packed / "source-index.jsonl", packed / "meta" / "index.jsonl")
    (packed / "source-index.jsonl").symlink_to(Path("meta") / "index.jsonl")
    assert len(shards.open_dataset(shards.SourceSpec(packed, subset=Subset(where="width > 0")), "train")) > 0
    set_source_index(packed, path="meta/index.jsonl")
    assert len(shards.open_dataset(shards.SourceSpec(packed, subset=Subset(where="width > 0")), "train")) > 0
    assert verify_dataset(packed).ok
    (packed / "meta" / "index.jsonl").write_text("{}\n")
    assert any("checksum" in p for p in verify_dataset(packed).problems)


def test_an_index_sidecar_symlinked_outside_is_refused(packed: Path, tmp_path: Path):
    sidecar = packed / "train-000000.tar.idx"
    outside = tmp_path / "elsewhere" / "x.idx"
    outside.parent.mkdir()
    shutil.move(sidecar, outside)
    sidecar.symlink_to(outside)
    dataset = shards.open_dataset(packed, "train", decode=shards.Decode(decoder=raw_bytes),
                                  sampling=shards.Sampling(shuffle=False))
    with pytest.raises(ManifestError, match="outside the dataset folder") as caught:
        list(dataset.read_slice(ShardSlice(0, 1, 3)))  # a slice past the first sample seeks by the index
    assert "tar index 'train-000000.tar.idx'" in str(caught.value) and str(outside) in str(caught.value)
    report = verify_dataset(packed)
    assert not report.ok and any("train-000000.tar.idx" in p and "outside the dataset folder" in p
                                 for p in report.problems)


def test_an_index_sidecar_is_confined_to_the_dataset_folder_not_to_its_shards_folder(packed: Path, tmp_path: Path):
    """``sub`` links out of the folder and its shard links back in: the shard is inside, the sidecar beside it is
    not, though it lies in the shard's own (resolved) folder."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (packed / "store").mkdir()
    shutil.move(packed / "train-000000.tar", packed / "store" / "train-000000.tar")
    (elsewhere / "train-000000.tar").symlink_to(packed / "store" / "train-000000.tar")
    shutil.move(packed / "train-000000.tar.idx", elsewhere / "train-000000.tar.idx")
    (packed / "sub").symlink_to(elsewhere)
    manifest = json.loads((packed / "dataset.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]
    entry.update(path="sub/train-000000.tar", index="sub/train-000000.tar.idx")
    (packed / "dataset.json").write_text(json.dumps(manifest))
    info = load_dataset_manifest(packed).splits["train"].shards[0]
    with pytest.raises(ManifestError, match="tar index .*outside the dataset folder"):
        load_local_index(packed / info.path, info)


# -- a node-cache copy changed in place ----------------------------------------------------------------------------
def raw_bytes(sample, seed):
    return bytes(sample.data)


def test_a_cached_copy_changed_in_place_is_not_served(tmp_path: Path, caplog):
    data = tmp_path / "data"
    make_shard_dataset(data, shard_sizes={"train": [3, 2]}, size=(16, 16))
    options = dict(return_keys=True, sampling=shards.Sampling(shuffle=False),
                   remote=shards.Remote(shard_cache=shards.ShardCache(tmp_path / "cache", local=True)),
                   decode=shards.Decode(decoder=raw_bytes))
    truth = {key: image for image, _, key in shards.open_dataset(data, **options)}
    (copy,) = [p for p in (tmp_path / "cache" / "v1").glob("??/*.tar")
               if p.read_bytes() == (data / "train-000000.tar").read_bytes()]
    key, image = next(iter(truth.items()))
    before = copy.stat()
    content = copy.read_bytes()
    at = content.index(image) + len(image) // 2
    with open(copy, "r+b") as handle:  # same size, same inode, mtime put back: the stamp cannot see it
        handle.seek(at)
        handle.write(bytes([content[at] ^ 0xFF]))
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))

    caplog.set_level(logging.WARNING, logger="shardcache.cache")
    dataset = shards.open_dataset(data, **options)  # a new job: its processes have checked no copy yet
    assert {k: v for v, _, k in dataset} == truth
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "train-000000.tar" in warnings[0] and "sha256" in warnings[0]
    assert dataset.shard_cache.stats.snapshot()["refetches"] == 1
    assert copy.read_bytes() == (data / "train-000000.tar").read_bytes()  # fetched again in its place
