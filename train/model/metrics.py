"""Classification metrics accumulated as sums, so ranks can add them up before anything is divided.

Everything derives from a confusion matrix plus a loss sum and a top-5 hit count: top-1, per-class accuracy and
the matrix itself come out equal whether one process saw all samples or several saw a share each.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

CONFUSION_IN_METRICS_MAX_CLASSES = 64  # a 1000x1000 matrix per epoch would swamp metrics.jsonl

TOP5_MIN_CLASSES = 6  # top-5 means something only when there are more than 5 classes


class ClassificationTally:
    """Running sums over batches: loss, samples, top-5 hits, and the [true, predicted] confusion matrix."""

    def __init__(self, num_classes: int, device: torch.device | str = "cpu"):
        self.num_classes = num_classes
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
        # float64 sums: a loss summed over a million samples in float32 loses digits that ranks then disagree on.
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss_sum, samples, top5_hits

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add one batch; ``loss_sum`` is the summed (not mean) loss of the batch."""
        predicted = logits.argmax(dim=1)
        index = labels * self.num_classes + predicted
        self.confusion += torch.bincount(index, minlength=self.num_classes**2).view(self.num_classes, -1)
        top5 = torch.zeros((), device=self.sums.device)
        if self.num_classes >= TOP5_MIN_CLASSES:
            top5 = (logits.topk(5, dim=1).indices == labels[:, None]).any(dim=1).sum()
        count = torch.tensor(float(len(labels)), device=self.sums.device)
        self.sums += torch.stack([loss_sum.detach().double(), count.double(), top5.double()])

    def all_reduce(self) -> None:
        """Sum across ranks (no-op without a process group)."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.confusion)
            dist.all_reduce(self.sums)

    @property
    def samples(self) -> int:
        return int(self.sums[1].item())

    def result(self, classes: Sequence[str], prefix: str = "val_") -> dict[str, Any]:
        """The JSON-ready metrics: loss, top-1, top-5 (over 5 classes), per-class accuracy, confusion matrix."""
        confusion = self.confusion.cpu()
        loss_sum, samples, top5 = (float(x) for x in self.sums.cpu())
        n = max(samples, 1.0)
        per_class_total = confusion.sum(dim=1)
        correct = confusion.diag()
        per_class = [
            (float(correct[i]) / float(per_class_total[i])) if per_class_total[i] > 0 else None
            for i in range(self.num_classes)
        ]
        out: dict[str, Any] = {
            f"{prefix}loss": loss_sum / n,
            f"{prefix}top1": float(correct.sum()) / n,
            f"{prefix}samples": int(samples),
            f"{prefix}per_class_accuracy": dict(zip(classes, per_class)),
            f"{prefix}confusion": confusion.tolist(),
        }
        if self.num_classes >= TOP5_MIN_CLASSES:
            out[f"{prefix}top5"] = top5 / n
        return out
