"""The eval geometry (``Resize(resize)`` + ``CenterCrop(crop)``) for a whole batch of decoded images in one kernel.

A GPU that decodes a batch with nvJPEG then resized it one image at a time: 256 small kernels per batch cost it 60%
of its decode rate (docs/gpu.md, G2). Here every image of a batch is copied into one padded tensor and
``torchvision.ops.roi_align`` samples each image's eval region (``shards.image.geometry.eval_source_region``, the
same box the CPU fast path resizes) to ``crop x crop`` at once. With ``sampling_ratio=-1`` each output pixel
averages ``ceil(scale)^2`` bilinear taps over its footprint: a box-filtered downscale close to the antialiased
resize (tests/shards/test_batch_crops.py holds it within 2 grey levels of ``resize_center_crop`` on photos), and
plain bilinear when upscaling, which is what antialiasing leaves unchanged.

The padding repeats each image's last row and column once, so a tap that falls in the half pixel past an edge reads
the edge (as a resize does), never the zeros of the padding. Images are cut into groups of ``max_pixels`` padded
pixels, which bounds the float copy's memory on the device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from shards.image.geometry import eval_source_region

MAX_PADDED_PIXELS = 64 * 512 * 512  # per group: 64 images of 512x512 are 200 MB of float32 on the device


def _groups(images: Sequence[torch.Tensor], max_pixels: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (count x largest height x largest width) stays in bounds; images
    sorted by size first, so that similar sizes share a group and padding stays small."""
    order = sorted(range(len(images)), key=lambda i: (images[i].shape[-2], images[i].shape[-1]))
    groups: list[list[int]] = []
    height = width = 0
    for i in order:
        h, w = (int(v) + 1 for v in images[i].shape[-2:])
        if groups and (len(groups[-1]) + 1) * max(height, h) * max(width, w) <= max_pixels:
            groups[-1].append(i)
            height, width = max(height, h), max(width, w)
        else:
            groups.append([i])
            height, width = h, w
    return groups


def _padded(images: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[N, C, H+1, W+1] with each image at the top left and its last row and column repeated once past its edge."""
    height = max(int(im.shape[-2]) for im in images) + 1
    width = max(int(im.shape[-1]) for im in images) + 1
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width), dtype=dtype)
    for n, image in enumerate(images):
        h, w = image.shape[-2:]
        out[n, :, :h, :w] = image
        out[n, :, :h, w] = image[:, :, w - 1]
        out[n, :, h, :w + 1] = out[n, :, h - 1, :w + 1]
    return out


def eval_crops(images: Sequence[torch.Tensor], resize: int, crop: int) -> torch.Tensor:
    """uint8 [3, H, W] images (one device, any sizes) -> uint8 [N, 3, crop, crop]: each one's eval view, from one
    ``roi_align`` per group of similar sizes instead of one resize per image."""
    from torchvision.ops import roi_align

    if not images:
        raise ValueError("eval_crops needs at least one image")
    device = images[0].device
    out = torch.empty((len(images), images[0].shape[0], crop, crop), dtype=torch.uint8, device=device)
    for group in _groups(images, MAX_PADDED_PIXELS):
        members = [images[i] for i in group]
        # float32 throughout: float16 cannot place a box edge past pixel 2048 to a fraction of a pixel.
        boxes = torch.tensor([[n, *eval_source_region(int(im.shape[-1]), int(im.shape[-2]), resize, crop)]
                              for n, im in enumerate(members)], dtype=torch.float32, device=device)
        # aligned=True: the boxes are in continuous coordinates (pixel i covers [i, i+1)), as PIL's and the fast
        # path's boxes are.
        sampled = roi_align(_padded(members, torch.float32), boxes, (crop, crop), spatial_scale=1.0,
                            sampling_ratio=-1, aligned=True)
        out[group] = sampled.round_().clamp_(0, 255).to(torch.uint8)
    return out
