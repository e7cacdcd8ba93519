"""What an example does with its data and model, per rank: events appended as JSON lines to
``$EXAMPLE_PROBE_DIR/rank-$RANK.jsonl`` (nothing is recorded where EXAMPLE_PROBE_DIR is unset).

- ``{"event": "pass", "dataset", "sampler", "epoch"}``: a ``DataLoader`` over ``dataset`` starts
  a pass; ``sampler`` is ``id()`` of the sampler it holds, ``epoch`` that sampler's epoch;
- ``{"event": "item", "dataset", "index"}``: the stand-in dataset was asked for ``index``;
- ``{"event": "set_epoch", "sampler", "epoch"}``: ``set_epoch`` was called on a loader's sampler;
- ``{"event": "end", "dataset", "sampler", "epoch"}``: at exit, each loader's sampler's epoch;
- ``{"event": "forward", "batch", "training"}``: the stand-in model ran on a batch.
"""
import atexit
import json
import os

_DIR = os.environ.get("EXAMPLE_PROBE_DIR", "")
_file = None
_loaders: list = []


def record(**event) -> None:
    global _file
    if not _DIR:
        return
    if _file is None:
        _file = open(os.path.join(_DIR, f"rank-{os.environ.get('RANK', '0')}.jsonl"), "a")
    _file.write(json.dumps(event) + "\n")
    _file.flush()


def dataset_name(dataset) -> str:
    return getattr(dataset, "name", type(dataset).__name__)


def _watch_set_epoch(cls) -> None:
    original = getattr(cls, "set_epoch", None)
    if original is None or getattr(original, "_probed", False):
        return

    def set_epoch(self, epoch):
        result = original(self, epoch)
        record(event="set_epoch", sampler=id(self), epoch=getattr(self, "epoch", epoch))
        return result

    set_epoch._probed = True
    cls.set_epoch = set_epoch


def watch_loaders() -> None:
    """Record each ``torch.utils.data.DataLoader``'s passes, and its sampler's ``set_epoch``
    calls and epoch at exit."""
    from torch.utils.data import DataLoader

    if getattr(DataLoader, "_probed", False):
        return
    init, start = DataLoader.__init__, DataLoader.__iter__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _watch_set_epoch(type(self.sampler))
        _loaders.append(self)

    def __iter__(self):
        record(event="pass", dataset=dataset_name(self.dataset), sampler=id(self.sampler),
               epoch=getattr(self.sampler, "epoch", None))
        return start(self)

    DataLoader.__init__, DataLoader.__iter__ = __init__, __iter__
    DataLoader._probed = True
    atexit.register(_at_exit)


def _at_exit() -> None:
    for loader in _loaders:
        record(event="end", dataset=dataset_name(loader.dataset), sampler=id(loader.sampler),
               epoch=getattr(loader.sampler, "epoch", None))
