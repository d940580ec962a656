"""One roi_align per batch gives the eval geometry of a per-image antialiased resize, within 2 grey levels."""

import torch
from torchvision.transforms.functional import pil_to_tensor

from shards.image.batch_crops import _groups, eval_crops
from shards.image.device import resize_center_crop
from tests.shards.test_fast import photo

SIZES = [(500, 375), (375, 500), (300, 300), (800, 600), (402, 490), (200, 150), (224, 224), (257, 600)]


def test_a_mixed_batch_matches_the_per_image_resize_within_two_grey_levels():
    images = [pil_to_tensor(photo(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    batched = eval_crops(images, 256, 224)
    assert batched.shape == (len(images), 3, 224, 224) and batched.dtype == torch.uint8
    for image, crop in zip(images, batched):
        reference = resize_center_crop(image, 256, 224)
        difference = (crop.float() - reference.float()).abs()
        assert float(difference.mean()) <= 2.0, tuple(image.shape)
        assert float(difference.max()) <= 16, tuple(image.shape)


def test_the_edges_read_the_image_not_the_padding():
    # A small white image batched with a large one: its padding is zeros, and any tap on it would darken the edge.
    white = torch.full((3, 230, 230), 255, dtype=torch.uint8)
    big = torch.zeros((3, 600, 800), dtype=torch.uint8)
    crops = eval_crops([white, big], 256, 224)
    assert int(crops[0].min()) == 255
    assert int(crops[1].max()) == 0


def test_groups_bound_the_padded_pixels_and_cover_every_image_once():
    images = [torch.zeros((3, h, w), dtype=torch.uint8) for h, w in [(10, 10), (400, 400), (12, 9), (390, 410)]]
    groups = _groups(images, max_pixels=2 * 411 * 411)
    assert sorted(i for group in groups for i in group) == [0, 1, 2, 3]
    for group in groups:
        height = max(images[i].shape[-2] for i in group) + 1
        width = max(images[i].shape[-1] for i in group) + 1
        assert len(group) == 1 or len(group) * height * width <= 2 * 411 * 411
    assert [0, 2] in [sorted(g) for g in groups]  # similar sizes share a group
