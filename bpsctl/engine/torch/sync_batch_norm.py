"""Horovod's ``SyncBatchNorm``: batch normalization over the batch of every rank together.

In training, the mean and variance of each channel are those of the whole job's batch, as if
every rank's samples were one batch: each rank sums its samples per channel (and counts
them), one allreduce (Sum) adds the sums of every rank, giving the mean; a second adds the
squared deviations from it, giving the variance (two passes, not the sum of squares, which
loses precision when the mean is large). Both allreduces are differentiable
(:func:`~bpsctl.engine.torch.mpi_ops.allreduce`: the gradient is the allreduce of the
gradient), so autograd computes the same input gradient as Horovod's hand-written backward
(the global sums of ``dy`` and ``dy * (x - mean)``); the weight and bias gradients stay each
rank's own, for the DistributedOptimizer to average, as in Horovod.

Unlike Horovod's, CPU tensors are accepted (the statistics are plain torch operations, not
the CUDA-only batch-norm kernels). With one rank, or in evaluation with running statistics,
it is torch's batch norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .mpi_ops import Sum, allreduce, size

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover every rank's batch (see the module
    docstring). Arguments as ``torch.nn.BatchNorm{1,2,3}d``'s: ``num_features`` (channels,
    dimension 1 of the input), ``eps``, ``momentum`` (None: a cumulative average),
    ``affine``, ``track_running_stats``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (got {input.dim()}D "
                             "input): samples along dimension 0, channels along dimension 1")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
        if (not self.training and self.track_running_stats) or size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, self.training or not self.track_running_stats,
                                self._factor(), self.eps)
        return self._synchronized(input)

    def _factor(self) -> float:
        """The running statistics' update factor (torch's: the momentum, or for a cumulative
        average 1 / batches so far)."""
        if self.momentum is not None:
            return self.momentum
        tracked = self.num_batches_tracked
        return 1.0 / float(tracked) if tracked is not None and int(tracked) > 0 else 0.0

    def _synchronized(self, input: torch.Tensor) -> torch.Tensor:
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        # half precision sums over many samples overflow or lose the mean: float32 for those
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        count = torch.tensor([input.numel() // channels], dtype=x.dtype, device=x.device)
        totals = allreduce(torch.cat([x.sum(dims), count]), op=Sum)
        n = totals[channels]
        mean = totals[:channels] / n
        centered = x - mean.view(shape)
        var = allreduce(centered.pow(2).sum(dims), op=Sum) / n
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None and self.bias is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None \
                and self.running_var is not None:
            factor = self._factor()
            with torch.no_grad():
                unbiased = var * (n / (n - 1).clamp(min=1))
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach() * factor)
        return out.to(input.dtype)
