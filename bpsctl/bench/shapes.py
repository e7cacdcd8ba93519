"""The parameter shapes of the training benchmarks' models (bpsctl/bench/models.py: VGG16 and
ResNet50 as torchvision defines them), without torch: the bench's own process counts a
model's values and its pushes per step from these, so that only its workers import torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

MODELS = ("vgg16", "resnet50")

#: VGG16's convolutions (output channels) and max pools ("M"), in order
VGG16_LAYERS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                512, 512, 512, "M")


def vgg16_shapes(num_classes: int = 1000) -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's vgg16, in its named_parameters() order."""
    shapes: list[tuple[int, ...]] = []
    channels = 3
    for layer in VGG16_LAYERS:
        if layer != "M":
            shapes += [(int(layer), channels, 3, 3), (int(layer),)]
            channels = int(layer)
    return shapes + [(4096, 512 * 7 * 7), (4096,), (4096, 4096), (4096,),
                     (num_classes, 4096), (num_classes,)]


def resnet50_shapes(num_classes: int = 1000) -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's resnet50, in its named_parameters() order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if block == 0:
                shapes += [(width * 4, inplanes, 1, 1), (width * 4,), (width * 4,)]
            inplanes = width * 4
    return shapes + [(num_classes, 2048), (num_classes,)]


@dataclass(eq=False)
class ShapeParameter:
    """A float32 parameter on the CPU, of ``shape``, as the engine's fusion
    (bpsctl/engine/fusion.py) and the bench's byte counts see a torch parameter."""

    shape: tuple[int, ...]
    dtype = "float32"
    device = "cpu"
    is_cuda = False
    requires_grad = True

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return 4


def parameters(name: str, num_classes: int = 1000) -> list[ShapeParameter]:
    """The parameters of the model called ``name`` (one of :data:`MODELS`), by shape."""
    if name == "vgg16":
        return [ShapeParameter(s) for s in vgg16_shapes(num_classes)]
    if name == "resnet50":
        return [ShapeParameter(s) for s in resnet50_shapes(num_classes)]
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
