"""VGG16 and ResNet50 as torchvision defines them (same layers, parameter shapes and names),
so the training benchmarks need no torchvision (whose PyPI wheel does not load on CPU torch).

VGG16: 138,357,544 parameters in 32 tensors; ResNet50: 25,557,032 in 161 tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from .shapes import MODELS
from .shapes import VGG16_LAYERS as _VGG16_LAYERS


class VGG(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in _VGG16_LAYERS:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(channels, int(v), kernel_size=3, padding=1),
                           nn.ReLU(inplace=True)]
                channels = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, width: int, stride: int = 1,
                 downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        # stride on the 3x3 convolution, as torchvision's ResNet v1.5
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, blocks[0])
        self.layer2 = self._make_layer(128, blocks[1], stride=2)
        self.layer3 = self._make_layer(256, blocks[2], stride=2)
        self.layer4 = self._make_layer(512, blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, width: int, count: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != width * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, width * Bottleneck.expansion, 1, stride=stride,
                          bias=False),
                nn.BatchNorm2d(width * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, width, stride, downsample)]
        self.inplanes = width * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, width) for _ in range(1, count)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def vgg16(num_classes: int = 1000) -> VGG:
    return VGG(num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    return ResNet((3, 4, 6, 3), num_classes)


def build(name: str, num_classes: int = 1000) -> nn.Module:
    """The model called ``name`` (one of :data:`MODELS`)."""
    if name == "vgg16":
        return vgg16(num_classes)
    if name == "resnet50":
        return resnet50(num_classes)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
