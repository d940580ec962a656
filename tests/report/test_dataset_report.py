"""The dataset section: counts as in dataset.json, the sample grid, skipped files, and untrusted strings escaped."""

from __future__ import annotations

import base64
import io
import json

from PIL import Image

from shards.formats.sample import RawSample
from shards.transport.storage import get_storage
from shards.manifest import ShardInfo, SplitInfo, load_dataset_manifest
from shards.provenance import SkippedFile, SourceInfo
from shards.report.build import build_report
from shards.units import human_bytes
from tests.helpers import PALETTE, make_shard_dataset
from tests.report.page import external_references, http_mentions, parse


def test_counts_shards_and_provenance_equal_the_manifest(dataset_dir):
    manifest = load_dataset_manifest(dataset_dir)
    page = parse(build_report([dataset_dir], grid=False))
    assert page.unbalanced == []
    html = build_report([dataset_dir])
    assert external_references(html) == [] and http_mentions(html) == []
    rows = page.table("label", "class", "train", "val", "total")
    assert [row[1] for row in rows] == list(manifest.classes)
    train, val = manifest.splits["train"].class_counts, manifest.splits["val"].class_counts
    assert [row[2:5] for row in rows] == [[f"{t:,}", f"{v:,}", f"{t + v:,}"] for t, v in zip(train, val)]
    shards = page.table("split", "shard", "samples", "bytes")
    expected = [[name, s.path, f"{s.samples:,}", human_bytes(s.bytes)]
                for name, split in manifest.splits.items() for s in split.shards]
    assert [row[:4] for row in shards] == expected
    imbalance = page.table("split", "smallest class")
    assert imbalance[0][:5] == ["train", "red", "16", "blue", "16"]  # 48 round-robin: 16 each, ties by label
    assert "None: all 60 files seen were packed." in page.text
    provenance = page.key_values("storage")
    assert provenance["packing: seed"] == "0" and provenance["storage"] == "tar"
    assert provenance["files seen"] == f"{manifest.source.files_seen:,}"


def _thumbnails(html: str) -> list[tuple[str, Image.Image]]:
    """(caption, image) for each sample in the grid."""
    import re

    found = re.findall(r'<figure><img src="data:image/jpeg;base64,([^"]+)"[^>]*><figcaption>([^<]*)</figcaption>',
                       html)
    return [(caption, Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")) for data, caption in found]


def test_sample_grid_shows_each_class_under_its_own_images(dataset_dir):
    thumbs = _thumbnails(build_report([dataset_dir]))
    assert [caption for caption, _ in thumbs] == ["red"] * 4 + ["green"] * 4 + ["blue"] * 4
    for caption, image in thumbs:
        # The generated images are their class colour plus noise: the thumbnail must be that colour.
        mean = [sum(band.histogram()[v] * v for v in range(256)) / (image.width * image.height)
                for band in image.split()]
        expected = PALETTE[("red", "green", "blue").index(caption)]
        assert max(range(3), key=lambda c: mean[c]) == max(range(3), key=lambda c: expected[c])
        assert max(image.size) <= 128


def test_no_grid_opens_no_shard(dataset_dir):
    for shard in dataset_dir.glob("*.tar"):
        shard.unlink()  # a report without the grid reads only dataset.json
    html = build_report([dataset_dir], grid=False)
    assert "<img" not in html and "Samples" not in parse(html).text


def test_an_undecodable_image_is_marked_and_the_report_still_builds(tmp_path):
    out = tmp_path / "broken"
    manifest = make_shard_dataset(out, classes=("a", "b"), shard_sizes={"train": [4]})
    with get_storage("tar").writer(out / "train-000001.tar", classes=("a", "b")) as writer:
        writer.write(RawSample("bad_00001", b"this is not a jpeg", "jpg", 0, b"{}"))
    info = ShardInfo("train-000001.tar", writer.samples, writer.bytes, writer.sha256)
    split = manifest.splits["train"]
    # The broken sample comes first for class a: its shard is listed before the good one.
    manifest.replace(splits={"train": SplitInfo(split.samples + 1, (split.class_counts[0] + 1, split.class_counts[1]),
                                                (info, *split.shards))}).save(out)
    html = build_report([out])
    assert parse(html).unbalanced == []
    assert html.count(">undecodable<") == 1  # the one broken sample; the other four are thumbnails
    assert html.count('<img src="data:image/jpeg;base64,') == 4


def test_skipped_files_are_listed_with_their_reasons(dataset_dir):
    manifest = load_dataset_manifest(dataset_dir)
    skipped = (SkippedFile("red/broken.jpg", "truncated JPEG"), SkippedFile("blue/empty.png", "zero-byte file"),
               SkippedFile("green/notes.jpg", "truncated JPEG"))
    manifest.replace(source=SourceInfo(manifest.source.kind, manifest.source.root, 63, skipped)).save(dataset_dir)
    assert json.loads((dataset_dir / "dataset.json").read_text())["source"]["skipped"][0] == {
        "path": "red/broken.jpg", "reason": "truncated JPEG"}  # the shape pack-shards writes
    page = parse(build_report([dataset_dir], grid=False))
    assert page.table("file", "reason") == [[s.path, s.reason] for s in skipped]
    assert "3 of 63 files seen were skipped" in page.text
    assert "2 x truncated JPEG" not in page.text  # reasons are counted in the chart, not repeated as prose


def test_untrusted_strings_are_text_never_markup(tmp_path):
    hostile = ('<script>alert(1)</script>', '"><img src=http://evil.example/x.png onerror=alert(2)>',
               "zz</td></tr></table><a href='https://evil.example'>")
    out = tmp_path / "hostile"
    manifest = make_shard_dataset(out, classes=tuple(sorted(hostile)), shard_sizes={"train": [6], "val": [3]})
    source = SourceInfo("imagefolder", "<b>root</b>", 10,
                        (SkippedFile("<svg onload=alert(3)>.jpg", "url(http://evil.example/y)"),))
    manifest.replace(source=source, packing={"seed": "<i>0</i>", "note": "javascript:alert(4)"}).save(out)
    html = build_report([out])
    page = parse(html)
    assert page.unbalanced == []
    assert page.tags.count("script") == 1  # the report's own table sorter, nothing from the manifest
    assert page.tags.count("img") == 6  # the sample grid's thumbnails only
    assert page.event_handlers == []
    assert external_references(html) == []  # no src, href or CSS url() leaves the page
    for name in hostile:
        assert name in page.text  # shown literally, as text
    assert "<b>root</b>" in page.text and "url(http://evil.example/y)" in page.text
