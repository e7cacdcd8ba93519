"""torchvision for the tests of Horovod's examples (its wheel does not load with CPU torch):
the names those examples use, on random data, recording what they do (``example_probe``)."""
import example_probe

from . import datasets, models, transforms

example_probe.watch_loaders()

__all__ = ["datasets", "models", "transforms"]
