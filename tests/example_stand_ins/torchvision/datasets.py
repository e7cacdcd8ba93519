"""``MNIST`` and ``ImageFolder`` with torchvision's signatures, on random images of the real
items' shapes: item ``i`` is the same on every rank (drawn from seed ``i``) and is recorded
(``example_probe``) each time it is fetched; ``transform`` is applied as torchvision does.

``MNIST``: 1x28x28 images, labels 0-9; ``$STAND_IN_MNIST_SIZES`` ("TRAIN,TEST", default
"60,10") items. ``ImageFolder``: 3x224x224 images, one item per file of ``root``'s class
directories (sorted, as torchvision's), labelled by its directory's place."""
import os

import example_probe
import torch


class _Random(torch.utils.data.Dataset):
    def __init__(self, name, shape, targets, transform=None, target_transform=None):
        self.name = name
        self.shape = shape
        self.targets = list(targets)
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        if not 0 <= index < len(self.targets):
            raise IndexError(f"{self.name}: index {index} of {len(self.targets)}")
        example_probe.record(event="item", dataset=self.name, index=int(index))
        image = torch.rand(self.shape, generator=torch.Generator().manual_seed(int(index)))
        target = self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class MNIST(_Random):
    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        train_size, test_size = (int(n) for n in
                                 os.environ.get("STAND_IN_MNIST_SIZES", "60,10").split(","))
        size = train_size if train else test_size
        super().__init__("train" if train else "test", (1, 28, 28),
                         [i % 10 for i in range(size)], transform, target_transform)
        self.root, self.train = root, train


class ImageFolder(_Random):
    def __init__(self, root, transform=None, target_transform=None, **kwargs):
        self.root = root
        self.classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples = [(os.path.join(root, name, file), self.class_to_idx[name])
                        for name in self.classes
                        for file in sorted(os.listdir(os.path.join(root, name)))]
        super().__init__(os.path.basename(os.path.normpath(root)), (3, 224, 224),
                         [target for _, target in self.samples], transform, target_transform)
