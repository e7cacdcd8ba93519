"""``resnet50`` with torchvision's signature: a small convolutional network (one strided
convolution, batch norm, pooling, a linear layer) whose forward passes are recorded
(``example_probe``)."""
import example_probe
import torch
from torch import nn


class _Small(nn.Sequential):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        example_probe.record(event="forward", batch=len(input), training=self.training)
        return super().forward(input)


def resnet50(weights=None, progress=True, num_classes=1000, norm_layer=nn.BatchNorm2d,
             **kwargs):
    return _Small(nn.Conv2d(3, 8, 7, stride=4, padding=3, bias=False), norm_layer(8),
                  nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                  nn.Linear(8, num_classes))
