"""Horovod's three PyTorch elastic examples (``examples/elastic/pytorch`` of a Horovod source
checkout: the synthetic benchmark, MNIST and ImageNet ResNet-50) under ``bpsctl run -np N
--min-workers N-1`` on 2 and 3 workers, each with its ``import horovod.torch as hvd`` line
replaced by ``import bpsctl.engine.torch as hvd`` and nothing else changed, kept small by their
own flags.

They read no real data: ``tests/example_stand_ins``, first on PYTHONPATH, holds a stand-in
``torchvision`` (random datasets of the real items' shapes, no-op transforms, a small network
for ``resnet50``) and ``torch.utils.tensorboard``; ``example_probe`` there records, per rank,
each DataLoader pass with its sampler's epoch, every index fetched, each ``set_epoch`` and each
forward pass. The examples are not copied here: ``BPSCTL_HOROVOD_EXAMPLES`` names the
``examples`` directory of a Horovod checkout (as for test_horovod_api.py's synthetic benchmark),
and these tests skip without it.
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from bpsctl.config import Config  # noqa: E402
from bpsctl.launch.api import run_local  # noqa: E402

#: the ``examples`` directory of a Horovod source checkout; not copied here
HOROVOD_EXAMPLES = os.environ.get("BPSCTL_HOROVOD_EXAMPLES", "")
REPO = Path(__file__).resolve().parent.parent
STAND_INS = Path(__file__).resolve().parent / "example_stand_ins"
HOROVOD_IMPORT = "import horovod.torch as hvd\n"

needs_examples = pytest.mark.skipif(
    not HOROVOD_EXAMPLES, reason="set BPSCTL_HOROVOD_EXAMPLES to the examples directory of a "
    "Horovod source checkout to run its elastic PyTorch examples")


def _run_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, workers: int,
                 args: list[str], **env: str) -> tuple[str, dict[int, list[dict[str, Any]]]]:
    """Horovod's ``elastic/pytorch/NAME``, its import line swapped, on ``workers`` workers with
    ARGS: the job's output and each rank's probe events. The job must succeed."""
    source = Path(HOROVOD_EXAMPLES, "elastic", "pytorch", name).read_text()
    horovod_imports = re.findall(r"^\s*(?:import|from)\s+horovod\b.*$", source, re.MULTILINE)
    assert horovod_imports == [HOROVOD_IMPORT.strip()], horovod_imports
    script = tmp_path / name
    script.write_text(source.replace(HOROVOD_IMPORT, "import bpsctl.engine.torch as hvd\n"))
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(STAND_INS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("EXAMPLE_PROBE_DIR", str(probe))
    monkeypatch.setenv("HOME", str(tmp_path))     # the MNIST example locks ~/.horovod_lock
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    log = io.StringIO()
    config = Config(state_dir=tmp_path / "state", heartbeat_interval_s=0.2,
                    start_timeout_s=30.0, op_timeout_s=30.0, min_workers=workers - 1)
    result = run_local([sys.executable, str(script), *args], workers, config, servers=1,
                       stdout=log, stderr=log)
    output = log.getvalue()
    assert result.exit_code == 0, output[-6000:]
    events = {rank: [json.loads(line) for line in
                     (probe / f"rank-{rank}.jsonl").read_text().splitlines()]
              for rank in range(workers)}
    return output, events


def _passes(events: list[dict[str, Any]], dataset: str) -> list[tuple[int, int, list[int]]]:
    """A rank's passes over ``dataset``: its loader's sampler's epoch at the start of each,
    the sampler's id, and the indices fetched in it."""
    passes: list[tuple[int, int, list[int]]] = []
    for event in events:
        if event.get("dataset") != dataset:
            continue
        if event["event"] == "pass":
            passes.append((event["epoch"], event["sampler"], []))
        elif event["event"] == "item":
            passes[-1][2].append(event["index"])
    return passes


def _set_epochs(events: list[dict[str, Any]], sampler: int) -> list[int]:
    return [e["epoch"] for e in events if e["event"] == "set_epoch" and e["sampler"] == sampler]


def _end_epoch(events: list[dict[str, Any]], dataset: str) -> int:
    """The epoch the loader over ``dataset`` had its sampler on when the rank exited."""
    ends = [e["epoch"] for e in events if e["event"] == "end" and e["dataset"] == dataset]
    assert len(ends) == 1, (dataset, ends)
    return ends[0]


def _check_in_step(events: dict[int, list[dict[str, Any]]], dataset: str, size: int,
                   epochs: list[int]) -> list[list[list[int]]]:
    """Every rank's loader over ``dataset`` made one pass per epoch of ``epochs`` with one
    sampler, on that epoch at the pass's start; in each pass the ranks fetched disjoint equal
    shares that together are the whole dataset (``size`` divides by the number of ranks, so
    nothing is padded). Returns each rank's indices per pass."""
    shares = []
    for rank, rank_events in events.items():
        passes = _passes(rank_events, dataset)
        assert [epoch for epoch, _, _ in passes] == epochs, (rank, dataset, passes)
        assert len({sampler for _, sampler, _ in passes}) == 1, (rank, dataset)
        shares.append([indices for _, _, indices in passes])
    for place, epoch in enumerate(epochs):
        fetched = [share[place] for share in shares]
        assert {len(f) for f in fetched} == {size // len(events)}, (dataset, epoch, fetched)
        assert sorted(i for f in fetched for i in f) == list(range(size)), (dataset, epoch)
    return shares


@pytest.mark.timeout(180)
@needs_examples
@pytest.mark.parametrize("workers", [2, 3])
def test_horovods_elastic_synthetic_benchmark_runs_with_only_its_import_changed(
        tmp_path, monkeypatch, workers):
    """``pytorch_synthetic_benchmark_elastic.py`` (``resnet50`` the stand-in's small network):
    2 warm-up batches and 3 iterations of 2, a commit every 2 batches; every rank runs the same
    8 training steps and rank 0 reports the total rate over all workers."""
    output, events = _run_example(
        tmp_path, monkeypatch, "pytorch_synthetic_benchmark_elastic.py", workers,
        ["--batch-size", "4", "--num-warmup-batches", "2", "--num-batches-per-iter", "2",
         "--num-iters", "3", "--num-batches-per-commit", "2", "--no-cuda"])
    assert f"Number of CPUs: {workers}" in output and "Iter #2:" in output, output[-4000:]
    assert f"Total img/sec on {workers} CPU(s)" in output, output[-4000:]
    for rank, rank_events in events.items():
        steps = [e["batch"] for e in rank_events if e["event"] == "forward" and e["training"]]
        assert steps == [4] * 8, (rank, steps)


@pytest.mark.timeout(180)
@needs_examples
@pytest.mark.parametrize("workers", [2, 3])
def test_horovods_elastic_mnist_keeps_every_rank_s_sampler_on_the_epoch(
        tmp_path, monkeypatch, workers):
    """``pytorch_mnist_elastic.py`` on 48 training and 24 test images (batches of 8 and 16),
    epochs 1 and 2 (``--epochs 2``; it counts from 1), a commit every batch: each epoch every
    rank's training loader is on that epoch (the example's ``set_epoch`` on its
    DistributedSampler, the loader's) and the ranks' shares of it are disjoint and cover the
    data; after the last epoch each rank's sampler is on epoch 2; the test pass covers the test
    set once and rank 0 prints the averaged result."""
    output, events = _run_example(
        tmp_path, monkeypatch, "pytorch_mnist_elastic.py", workers,
        ["--batch-size", "8", "--test-batch-size", "16", "--epochs", "2", "--log-interval", "1",
         "--no-cuda", "--data-dir", str(tmp_path / "data")], STAND_IN_MNIST_SIZES="48,24")
    shares = _check_in_step(events, "train", 48, [1, 2])
    _check_in_step(events, "test", 24, [0])
    assert any(a != b for a, b in shares), "the epochs' shards are the same"
    for rank, rank_events in events.items():
        sampler = _passes(rank_events, "train")[0][1]
        assert _set_epochs(rank_events, sampler) == [1, 2], rank
        assert _end_epoch(rank_events, "train") == 2 and _end_epoch(rank_events, "test") == 0
    assert output.count("Test set: Average loss") == 1, output[-4000:]


@pytest.mark.timeout(180)
@needs_examples
@pytest.mark.parametrize("workers", [2, 3])
def test_horovods_elastic_imagenet_resnet50_keeps_every_rank_s_sampler_on_the_epoch(
        tmp_path, monkeypatch, workers):
    """``pytorch_imagenet_resnet50_elastic.py`` on an ImageFolder of 24 training and 12
    validation images in 2 classes (batches of 4), 2 epochs, a commit every 2 batches and a
    host check between: the ElasticSampler its DataLoader holds is the one the example keeps in
    TorchState (``state.train_sampler.set_epoch`` reaches it), on epoch 0, then 1, at the start
    of each epoch and on 2 after the last; each epoch the ranks' shares of the training and
    validation images are disjoint and cover them; rank 0 logs each epoch's metrics and writes
    its checkpoints."""
    for split, count in (("train", 24), ("val", 12)):
        for i in range(count):
            image = tmp_path / "imagenet" / split / f"n0{i % 2}" / f"{i:03}.JPEG"
            image.parent.mkdir(parents=True, exist_ok=True)
            image.touch()
    output, events = _run_example(
        tmp_path, monkeypatch, "pytorch_imagenet_resnet50_elastic.py", workers,
        ["--train-dir", str(tmp_path / "imagenet" / "train"),
         "--val-dir", str(tmp_path / "imagenet" / "val"), "--log-dir", str(tmp_path / "logs"),
         "--checkpoint-format", str(tmp_path / "checkpoint-{epoch}.pth.tar"),
         "--batch-size", "4", "--val-batch-size", "4", "--epochs", "2",
         "--batches-per-commit", "2", "--batches-per-host-check", "1", "--no-cuda"])
    shares = _check_in_step(events, "train", 24, [0, 1])
    _check_in_step(events, "val", 12, [0, 0])
    assert any(a != b for a, b in shares), "the epochs' shards are the same"
    for rank, rank_events in events.items():
        sampler = _passes(rank_events, "train")[0][1]
        assert _set_epochs(rank_events, sampler) == [1, 2], rank
        assert _end_epoch(rank_events, "train") == 2 and _end_epoch(rank_events, "val") == 0
    scalars = [json.loads(line) for line in
               (tmp_path / "logs" / "scalars.jsonl").read_text().splitlines()]
    assert sorted((s["tag"], s["step"]) for s in scalars) == sorted(
        (f"{split}/{metric}", epoch) for split in ("train", "val")
        for metric in ("loss", "accuracy") for epoch in (0, 1)), scalars
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-1.pth.tar", "checkpoint-2.pth.tar"], output[-4000:]
