"""The transforms Horovod's examples use, as no-ops (the stand-in datasets give tensors of the
shapes the examples' transforms would make); ``Compose`` applies its list in turn."""


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, item):
        for transform in self.transforms:
            item = transform(item)
        return item


class _NoOp:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, item):
        return item


class ToTensor(_NoOp):
    pass


class Normalize(_NoOp):
    pass


class Resize(_NoOp):
    pass


class CenterCrop(_NoOp):
    pass


class RandomResizedCrop(_NoOp):
    pass


class RandomHorizontalFlip(_NoOp):
    pass
