"""The crop geometry every backend shares: torchvision's sizes and boxes, drawn only from the given generator."""

import random

import pytest
import torch
import torchvision.transforms as T

from shards.image.geometry import (RANDOM_CROP_RATIO, Box, center_crop_box, eval_resize_size, eval_source_region,
                                   random_resized_crop_box, train_view)


@pytest.mark.parametrize("width,height", [(500, 375), (375, 500), (300, 300), (257, 1000), (97, 61)])
def test_eval_size_and_centre_box_are_torchvisions(width, height):
    image = torch.zeros(1, height, width)
    size = eval_resize_size(width, height, 256)
    assert tuple(T.Resize(256, antialias=True)(image).shape[-2:]) == size
    box = center_crop_box(size.width, size.height, 224)
    marked = torch.arange(size.height * size.width).view(1, size.height, size.width)
    assert torch.equal(T.CenterCrop(224)(marked), marked[:, box.top : box.bottom, box.left : box.right])


def test_box_converts_to_pils_order_and_source_region_scales_back():
    box = Box(top=2, left=3, height=10, width=20)
    assert box.ltrb() == (3, 2, 23, 12) and (box.bottom, box.right) == (12, 23)
    assert eval_source_region(512, 512, 256, 224) == pytest.approx((32, 32, 480, 480))
    with pytest.raises(ValueError, match="does not fit"):
        center_crop_box(100, 50, 64)


def test_random_resized_crop_is_seeded_valid_and_falls_back_like_torchvision():
    boxes = [random_resized_crop_box(500, 375, (0.08, 1.0), RANDOM_CROP_RATIO, random.Random(s)) for s in range(300)]
    assert all(0 <= b.left < b.right <= 500 and 0 <= b.top < b.bottom <= 375 for b in boxes)
    assert len(set(boxes)) > 250
    again = random_resized_crop_box(500, 375, (0.08, 1.0), RANDOM_CROP_RATIO, random.Random(7))
    assert again == boxes[7]
    # A 10:1 strip never fits a crop of aspect <= 4/3 covering >= 99% of it: the central fallback, as torchvision.
    assert random_resized_crop_box(1000, 100, (0.99, 1.0), RANDOM_CROP_RATIO, random.Random(0)) == Box(0, 433, 100, 133)


def test_train_view_draws_the_box_then_the_flip():
    flips = [train_view(64, 64, (0.5, 1.0), RANDOM_CROP_RATIO, 0.5, random.Random(s))[1] for s in range(200)]
    assert 60 < sum(flips) < 140
    assert not any(train_view(64, 64, (0.5, 1.0), RANDOM_CROP_RATIO, 0.0, random.Random(s))[1] for s in range(50))
    rng = random.Random(3)
    box = random_resized_crop_box(64, 64, (0.5, 1.0), RANDOM_CROP_RATIO, rng)
    assert train_view(64, 64, (0.5, 1.0), RANDOM_CROP_RATIO, 0.5, random.Random(3)) == (box, rng.random() < 0.5)
