"""Validation: every real image mode passes, broken files fail with a reason, re-encoding gives sane RGB JPEGs."""

import io

import pytest
from PIL import Image

from preprocess.pack.validate import InvalidImage, ValidateOptions, read_and_validate, validate_image
from tests.preprocess import corpus

FULL = ValidateOptions(verify="full")
HEADER = ValidateOptions(verify="header")


@pytest.mark.parametrize("kind", sorted(corpus.GOOD_KINDS))
@pytest.mark.parametrize("opts", [FULL, HEADER], ids=["full", "header"])
def test_every_image_kind_is_stored_as_it_is(kind, opts):
    data = corpus.GOOD_KINDS[kind]()
    result = validate_image(data, opts)
    assert result.data == data  # original bytes, no quality loss
    assert result.ext == {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[result.format]


def test_metadata_reports_the_displayed_size_and_source_mode():
    rotated = validate_image(corpus.exif_rotated_jpeg(size=(40, 20)), FULL)
    assert (rotated.width, rotated.height) == (20, 40)
    assert validate_image(corpus.cmyk_jpeg(), FULL).mode == "CMYK"
    assert validate_image(corpus.sixteen_bit_png(), FULL).mode.startswith("I")


@pytest.mark.parametrize("data, reason", [
    (b"", "empty file"),
    (b"plain text pretending to be a JPEG\n" * 3, "not an image"),
    (corpus.truncated_jpeg(), "truncated or corrupt"),
    (corpus.huge_png_header(), "too large: 30000x20000"),
])
def test_broken_files_are_rejected_with_a_reason(data, reason):
    with pytest.raises(InvalidImage, match=reason):
        validate_image(data, FULL)


def test_header_check_is_cheap_and_misses_truncated_jpeg_data():
    assert validate_image(corpus.truncated_jpeg(), HEADER).format == "JPEG"
    with pytest.raises(InvalidImage, match="empty file"):
        validate_image(b"", HEADER)


def test_huge_image_is_rejected_from_the_header_even_when_re_encoding():
    with pytest.raises(InvalidImage, match="only JPEG can be downscaled"):
        validate_image(corpus.huge_png_header(), ValidateOptions(resize_max_side=64))


def test_oversized_jpeg_is_drafted_down_when_re_encoding():
    big = corpus.encode(corpus.rgb_image((1600, 1200)), "JPEG", quality=80)
    opts = ValidateOptions(max_pixels=100_000, resize_max_side=128)
    with pytest.raises(InvalidImage, match="too large"):
        validate_image(big, ValidateOptions(max_pixels=100_000))
    result = validate_image(big, opts)
    assert (result.width, result.height) == (128, 96)
    assert Image.open(io.BytesIO(result.data)).size == (128, 96)


@pytest.mark.parametrize("kind", sorted(corpus.GOOD_KINDS))
def test_re_encoding_turns_every_mode_into_a_bounded_rgb_jpeg(kind):
    result = validate_image(corpus.GOOD_KINDS[kind](), ValidateOptions(resize_max_side=16, quality=85))
    image = Image.open(io.BytesIO(result.data))
    assert image.format == "JPEG" and image.mode == "RGB" and result.ext == "jpg"
    assert max(image.size) == 16 and image.size == (result.width, result.height)


def test_re_encoding_applies_exif_orientation_and_whitens_alpha():
    rotated = Image.open(io.BytesIO(validate_image(corpus.exif_rotated_jpeg((40, 20)),
                                                   ValidateOptions(quality=95)).data))
    assert rotated.size == (20, 40)
    assert not rotated.getexif().get(0x0112)  # orientation baked in, not applied twice by readers
    rgba = Image.open(io.BytesIO(validate_image(corpus.rgba_png(), ValidateOptions(quality=95)).data))
    right = rgba.getpixel((rgba.width - 2, rgba.height // 2))
    assert min(right) > 235  # transparent red became white, not red or black
    sixteen = Image.open(io.BytesIO(validate_image(corpus.sixteen_bit_png(), ValidateOptions(quality=95)).data))
    assert sixteen.getpixel((0, 0))[0] < 20 and sixteen.getpixel((sixteen.width - 1, sixteen.height - 1))[0] > 235


def test_unreadable_file_is_a_skip_reason(tmp_path):
    with pytest.raises(InvalidImage, match="^no such file$"):
        read_and_validate(str(tmp_path / "gone.jpg"), FULL)
