"""``precompute_features``: the Python call behind ``precompute-features``, for notebooks and orchestrators.

Its keywords are the command's options, underscored (``--format`` is ``storage``, ``--source`` ``shard_source``,
``--split`` ``splits``: the names ``FeatureConfig`` records); the command parses its options and calls this.
torch is imported when it runs, not when this module is.
"""

from __future__ import annotations

import os
from typing import Any

from preprocess.pack.api import stage_root
from preprocess.staging import resolve_stage, run_staged
from shards.atomic import on_disk_full
from shards.transport.location import locate


def precompute_features(data_dir: str | os.PathLike, out: str | os.PathLike, *, weights: str,
                        backbone: str = "resnet50", device: str = "auto", batch_size: int = 64,
                        workers: int | None = None, dtype: str = "float16", stage_dir: str | None = None,
                        break_lease: bool = False, **options: Any) -> dict[str, Any]:
    """Cache a frozen backbone's penultimate features of every image shard in ``data_dir`` under ``out``, as
    ``precompute-features DATA_DIR --out OUT --weights W`` does; returns the summary the command prints as JSON.

    ``weights``: ``"none"`` (random init), a local state-dict file, or a torchvision weights name already in the
    hub cache. ``workers=None`` is the shared default (``shards.cli.common.default_workers``; 0: in this process).
    ``options``: the other fields of ``preprocess.features.featurize.FeatureConfig`` (``seed``, ``resize``,
    ``crop``, ``mean``, ``std``, ``interpolation``, ``views``, ``augment``, ``storage``, ``amp``, ``decode``,
    ``device_share``, ``decode_check``, ``splits``, ``task_index``, ``num_tasks``, ``overwrite``, ``quiet``,
    ``storage_options``, ``cache``, ``shard_source``); an unknown one is a ``TypeError`` naming it.
    ``decode_check=N`` (``--decode-check N``): with ``decode="device"``, 1 in N images decoded again on the CPU and
    compared (0: no check)."""
    from preprocess.features.featurize import FeatureConfig, run_precompute
    from preprocess.features.state import features_spec
    from shards.cli.common import default_workers

    out = str(out)
    staged = None
    if locate(out).publishable:  # staged here, then uploaded (preprocess.staging)
        staged = resolve_stage(out, stage_dir, stage_root(), num_tasks=options.get("num_tasks", 1),
                               options=options.get("storage_options"), overwrite=options.get("overwrite", False),
                               break_lease=break_lease)
    elif stage_dir is not None or break_lease:
        from shards.errors import InputError

        raise InputError(f"{'--stage-dir' if stage_dir is not None else '--break-lease'} works only with --out "
                         "s3://...")
    cfg = FeatureConfig(data_dir=str(data_dir), out_dir=out if staged is None else str(staged.stage_dir),
                        backbone=backbone, weights=weights, device=device, batch_size=batch_size, dtype=dtype,
                        workers=default_workers() if workers is None else workers, **options)
    if staged is not None:
        _, summary = run_staged(staged, lambda stage: run_precompute(cfg), features_spec())
    else:
        with on_disk_full(cfg.out_dir):  # what a writer below raised as a bare OSError (a full disk: one line, exit 1)
            _, summary = run_precompute(cfg)
    return summary
