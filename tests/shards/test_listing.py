"""``Location.list`` (``shards.transport.listing``): one rule for local folders and globs, ``s3://`` prefixes and
brace patterns of any kind, and one retried lister of ``s3://`` prefixes for ``shards index`` and the publish alike.
The lister against a real server: ``tests/s3/test_adopt_s3.py`` and ``tests/s3/test_s3_write.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shards.errors import CorruptDataError, InputError, MissingInputError
from shards.publish.s3_upload import list_prefix
from shards.transport import s3
from shards.transport.location import locate
from shards.transport.s3 import S3Options
from tests.helpers import serve_folder


def _tree(root: Path) -> Path:
    for name, size in (("a.tar", 3), ("sub/b.tar", 5), ("sub/deeper/c.tar", 7), ("notes.txt", 1),
                       ("sub/d.json", 2)):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)
    return root


def test_a_local_folder_lists_its_matching_files_at_any_depth_in_name_order(tmp_path):
    listing = locate(_tree(tmp_path / "src")).list("*.tar")
    assert listing.base.local_path() == tmp_path / "src" and not listing.refused
    assert [f.rel for f in listing.files] == ["a.tar", "sub/b.tar", "sub/deeper/c.tar"]
    assert [f.size for f in listing.files] == [3, 5, 7]
    c = listing.files[2]
    assert c.location.local_path() == tmp_path / "src/sub/deeper/c.tar"
    assert c.version == {"mtime_ns": os.stat(c.location.text).st_mtime_ns}
    assert [f.rel for f in locate(tmp_path / "src").list("*.json").files] == ["sub/d.json"]  # the same rule


def test_a_brace_pattern_names_exactly_its_files_under_their_deepest_common_folder(tmp_path):
    _tree(tmp_path / "src")
    listing = locate(str(tmp_path / "src/sub/{b,deeper/c}.tar")).list("*.tar")
    assert listing.base.local_path() == tmp_path / "src/sub"
    assert [f.rel for f in listing.files] == ["b.tar", "deeper/c.tar"]
    with pytest.raises(MissingInputError, match="no such tar file"):
        locate(str(tmp_path / "src/{a,z}.tar")).list("*.tar")


def test_a_folder_without_matching_files_is_missing_input_naming_what_was_looked_for(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingInputError, match="holds no .tar files"):
        locate(tmp_path / "empty").list("*.tar")
    with pytest.raises(MissingInputError, match=r"holds no files matching x\?\.bin"):
        locate(tmp_path / "empty").list("x?.bin")


def test_a_local_file_resolving_outside_the_folder_is_refused_unread_and_the_rest_listed(tmp_path):
    src = _tree(tmp_path / "src")
    (tmp_path / "secret.tar").write_bytes(b"s")
    (src / "link.tar").symlink_to(tmp_path / "secret.tar")
    listing = locate(src).list("*.tar")
    assert [f.rel for f in listing.files] == ["a.tar", "sub/b.tar", "sub/deeper/c.tar"]
    assert [name for name, _ in listing.refused] == ["link.tar"]
    assert "resolves outside" in listing.refused[0][1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_folder(_tree(tmp_path_factory.mktemp("served"))) as url:  # its shutdown waits out a poll: not timed
        yield url


def test_http_lists_only_spelled_names_and_a_pipe_or_foreign_url_not_at_all(served):
    url = served
    listing = locate(url + "/sub/{b,deeper/c}.tar").list("*.tar")
    assert listing.base.text == url + "/sub" and [f.size for f in listing.files] == [5, 7]
    assert [f.location.text for f in listing.files] == [url + "/sub/b.tar", url + "/sub/deeper/c.tar"]
    assert not locate(url).can_list
    with pytest.raises(InputError, match="HTTP has no listing"):
        locate(url + "/sub").list("*.tar")
    with pytest.raises(InputError, match="cannot be listed"):
        locate("pipe:cat x.tar").list("*.tar")
    with pytest.raises(InputError, match="cannot be listed: it is not a folder"):
        locate("gs://bucket/shards").list("*.tar")


# -- the one s3:// lister ---------------------------------------------------------------------------------------------
PAGE = """<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>bkt</Name><Prefix>p/</Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys>
  <IsTruncated>{truncated}</IsTruncated>
  <Contents><Key>p/a.tar</Key><Size>10</Size><ETag>"e0"</ETag><LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>
  <Contents><Key>p/x/b.tar</Key><Size>11</Size><ETag>"e1"</ETag><LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>
</ListBucketResult>"""
SLOW_DOWN = b"""<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"""


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_: object):
        yield self.data


@pytest.fixture(scope="module", autouse=True)
def botocore_model():
    """botocore's S3 model loaded once (the session outlives the tests' own clients), before the timed calls."""
    try:
        s3.make_client(S3Options(endpoint_url="http://127.0.0.1:9", unsigned=True, region="us-east-1"))
    except InputError:  # no boto3: the s3 tests below skip
        pass


def _answering(monkeypatch, answers: list[tuple[int, bytes]]) -> tuple[S3Options, list[int]]:
    """S3Options whose client answers each ListObjectsV2 with the next of ``answers`` (status, body), sending
    nothing anywhere; the list of statuses sent so far comes back too."""
    pytest.importorskip("boto3")
    from botocore.awsrequest import AWSResponse

    options = S3Options(endpoint_url="http://127.0.0.1:9", unsigned=True, region="us-east-1", max_attempts=3)
    sent: list[int] = []

    def answer(request, **_: object):
        status, body = answers[min(len(sent), len(answers) - 1)]
        sent.append(status)
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))

    monkeypatch.setattr(s3, "_clients", {})  # a client of this test's own, forgotten afterwards
    monkeypatch.setattr(s3, "BACKOFF_BASE_S", 0.0)
    s3.make_client(options).meta.events.register("before-send.s3.ListObjectsV2", answer)
    return options, sent


def test_the_publish_and_the_index_list_through_one_lister_that_retries_a_slow_down(monkeypatch):
    page = PAGE.format(truncated="false").encode()
    options, sent = _answering(monkeypatch, [(503, SLOW_DOWN), (200, page)])
    assert list_prefix("s3://bkt/p", options) == {"a.tar": 10, "x/b.tar": 11}
    assert sent == [503, 200]  # the publish's check of a prefix used to give up at the first 503
    options, sent = _answering(monkeypatch, [(503, SLOW_DOWN), (200, page)])
    listing = locate("s3://bkt/p", storage_options=options).list("*.tar")
    assert [f.rel for f in listing.files] == ["a.tar", "x/b.tar"] and sent == [503, 200]
    assert listing.files[1].location.text == "s3://bkt/p/x/b.tar"
    assert listing.files[1].version == {"etag": '"e1"', "last_modified": "2026-01-01T00:00:00+00:00"}


def test_a_listing_truncated_without_a_continuation_token_is_corrupt_for_every_caller(monkeypatch):
    options, _ = _answering(monkeypatch, [(200, PAGE.format(truncated="true").encode())])
    with pytest.raises(CorruptDataError, match="no continuation token"):
        list_prefix("s3://bkt/p", options)
    with pytest.raises(CorruptDataError, match="no continuation token"):
        locate("s3://bkt/p", storage_options=options).list("*.tar")
