"""Run by every Python process that has this directory on its PYTHONPATH (the jobs of
tests/test_horovod_elastic_examples.py): ``torch.utils.tensorboard`` is served by
``tensorboard_stand_in.py`` here, since tensorboard is not among the test dependencies. Nothing
else is touched, and nothing is imported until a script imports that module."""
import importlib.abc
import importlib.util
import os
import sys


class _TensorboardStandIn(importlib.abc.MetaPathFinder):
    """Finds ``torch.utils.tensorboard`` in ``tensorboard_stand_in.py``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.utils.tensorboard":
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(os.path.dirname(__file__), "tensorboard_stand_in.py"))


sys.meta_path.insert(0, _TensorboardStandIn())
