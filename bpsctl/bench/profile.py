"""Training-step profiles: where one step of VGG16 or ResNet50 spends its time, recorded on a
real device (`bpsctl profile`) and replayed by `bpsctl bench MODEL --replay PROFILE`.

A profile is a JSON file (:data:`VERSION`; the schema is docs/replay.md's): the forward pass's
seconds, each parameter's gradient-ready offset from the start of backward (in registration
order, with its name, shape and dtype), the backward pass's and the optimizer step's seconds,
each the median over the timed steps, and what it was recorded on (device, torch, batch and
image size). A derived profile (``source: derived``) is another profile's time fractions
scaled to step times measured elsewhere, and says so in ``derived_from`` and ``note``.

The decisions of recording and replay are pure functions here (medians, the replay schedule,
the time dilation and its relabelling of the figures), so that they are tested without a GPU;
the stand-in model that replays a profile is :mod:`bpsctl.bench.replay`'s.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..config import MIN_HOST_CPU, ConfigError

#: the schema's version; a file of another version is refused, naming both
VERSION = 1
#: the ``kind`` every profile carries (other JSON files are not profiles)
KIND = "bpsctl-profile"
SOURCES = ("recorded", "derived")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16", "float64")
#: the package and folder of the shipped profiles (``<name>.json``)
SHIPPED = ("bpsctl.bench", "profiles")


@dataclass(frozen=True)
class ParameterTiming:
    """One parameter: its name, shape and dtype as the model registers it, and when its
    gradient was ready, in seconds from the start of backward."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ready_s: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class Profile:
    """A training step's timing (see the module's docstring); seconds are medians."""

    model: str
    device: str
    device_name: str
    torch_version: str
    batch_size: int
    image_size: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    parameters: tuple[ParameterTiming, ...]
    num_classes: int = 1000
    steps: int = 0
    warmup: int = 0
    threads: int = 0                     # torch's CPU threads while recording (0: not said)
    step_s: float = 0.0                  # the whole step, median (0: forward+backward+optimizer)
    recorded_at: str = ""
    source: str = "recorded"
    derived_from: str = ""
    note: str = ""

    @property
    def total_s(self) -> float:
        """Seconds of one step as replayed: forward, backward, optimizer step."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def nbytes(self) -> int:
        """The model's parameters' bytes (as many as its gradients')."""
        return sum(p.nbytes for p in self.parameters)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["parameters"] = [{**dataclasses.asdict(p), "shape": list(p.shape)}
                              for p in self.parameters]
        return {"version": VERSION, "kind": KIND, **data}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")


class ProfileError(ConfigError):
    """A profile that cannot be used: the message names the file (or shipped name) and what
    is wrong with it."""


# --------------------------------------------------------------------------- loading

def _number(where: str, data: dict[str, Any], key: str, kind: type = float,
            least: float = 0.0) -> Any:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (kind is int and not isinstance(value, int)) or not math.isfinite(value) \
            or value < least:
        expected = "a whole number" if kind is int else "a number of seconds"
        raise ProfileError(f"{where}: {key}: expected {expected} of at least {least:g}, got "
                           f"{value!r}")
    return kind(value)


def _text(where: str, data: dict[str, Any], key: str, choices: Sequence[str] = (),
          required: bool = True) -> str:
    value = data.get(key, None if required else "")
    if not isinstance(value, str) or (choices and value not in choices):
        expected = f"one of {', '.join(choices)}" if choices else "text"
        raise ProfileError(f"{where}: {key}: expected {expected}, got {value!r}")
    return value


def _parameter(where: str, index: int, entry: Any) -> ParameterTiming:
    at = f"{where}: parameters[{index}]"
    if not isinstance(entry, dict):
        raise ProfileError(f"{at}: expected an object with name, shape, dtype, ready_s, got "
                           f"{entry!r}")
    name = _text(at, entry, "name")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              and d > 0 for d in shape):
        raise ProfileError(f"{at} ({name}): shape: expected a list of positive whole numbers, "
                           f"got {shape!r}")
    return ParameterTiming(name=name, shape=tuple(shape), dtype=_text(at, entry, "dtype", DTYPES),
                           ready_s=_number(at, entry, "ready_s"))


def from_json(data: Any, where: str) -> Profile:
    """A :class:`Profile` from its JSON; :class:`ProfileError` naming ``where`` and the key
    for anything that is not this version's schema."""
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ProfileError(f"{where}: not a bpsctl profile (expected a JSON object with "
                           f"kind = {KIND!r}; `bpsctl profile MODEL -o FILE` writes one)")
    if data.get("version") != VERSION:
        raise ProfileError(f"{where}: version: this bpsctl reads profiles of version {VERSION}, "
                           f"got {data.get('version')!r}; record it again with `bpsctl profile`")
    from .models import MODELS
    backward_s = _number(where, data, "backward_s")
    entries = data.get("parameters")
    if not isinstance(entries, list) or not entries:
        raise ProfileError(f"{where}: parameters: expected a list of the model's parameters, "
                           f"got {entries!r}")
    parameters = tuple(_parameter(where, i, entry) for i, entry in enumerate(entries))
    names = [p.name for p in parameters]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ProfileError(f"{where}: parameters: {twice!r} is listed twice")
    source = _text(where, data, "source", SOURCES)
    derived_from = _text(where, data, "derived_from", required=False)
    note = _text(where, data, "note", required=False)
    if source == "derived" and not (derived_from and note):
        raise ProfileError(f"{where}: a derived profile must say what it was derived from and "
                           "how (derived_from and note)")
    return Profile(model=_text(where, data, "model", MODELS),
                   device=_text(where, data, "device", DEVICES),
                   device_name=_text(where, data, "device_name"),
                   torch_version=_text(where, data, "torch_version"),
                   batch_size=_number(where, data, "batch_size", int, 1),
                   image_size=_number(where, data, "image_size", int, 1),
                   forward_s=_number(where, data, "forward_s"), backward_s=backward_s,
                   optimizer_s=_number(where, data, "optimizer_s"), parameters=parameters,
                   num_classes=_number(where, data, "num_classes", int, 1)
                   if "num_classes" in data else 1000,
                   steps=_number(where, data, "steps", int) if "steps" in data else 0,
                   warmup=_number(where, data, "warmup", int) if "warmup" in data else 0,
                   threads=_number(where, data, "threads", int) if "threads" in data else 0,
                   step_s=_number(where, data, "step_s") if "step_s" in data else 0.0,
                   recorded_at=_text(where, data, "recorded_at", required=False),
                   source=source, derived_from=derived_from, note=note)


def _shipped_dir() -> Any:
    return resources.files(SHIPPED[0]) / SHIPPED[1]


def shipped_names() -> list[str]:
    """The profiles that come with bpsctl, by name (``cpu-resnet50``, ``h200-vgg16``, ...)."""
    return sorted(entry.name.removesuffix(".json") for entry in _shipped_dir().iterdir()
                  if entry.name.endswith(".json"))


def read(path: Path | str) -> Profile:
    """The profile in the file ``path``; :class:`ProfileError` naming it when it is missing,
    unreadable, cut short, of another version or not a profile."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read it ({exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProfileError(f"{path}: not JSON, or cut short ({exc}); was `bpsctl profile` "
                           "stopped while it wrote it?") from None
    return from_json(data, str(path))


def resolve(name_or_path: str) -> tuple[str, Path]:
    """(the name a report gives it, its file) of a shipped profile's name or a file's path;
    :class:`ProfileError` listing the shipped names when it is neither."""
    names = shipped_names()
    if name_or_path in names:
        with resources.as_file(_shipped_dir() / f"{name_or_path}.json") as path:
            return name_or_path, Path(path)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.name.removesuffix(".json"), path.resolve()
    raise ProfileError(f"--replay: {name_or_path!r} is neither a file nor a shipped profile "
                       f"({', '.join(names)}; `bpsctl profile --list` describes them)")


def load(name_or_path: str) -> Profile:
    """The profile named (shipped) or in the file given."""
    return read(resolve(name_or_path)[1])


# --------------------------------------------------------------------------- recording

@dataclass
class StepTimes:
    """One timed step: seconds of its phases, and each parameter's ready offset (registration
    order; None for a parameter whose gradient never came)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    ready_s: list[float | None] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


def summarize(steps: Sequence[StepTimes]) -> dict[str, Any]:
    """The medians over ``steps`` of each phase and of each parameter's ready offset. A
    parameter without a gradient in some step (ValueError) means the model did not use it:
    a replay could not make it ready at any time."""
    if not steps:
        raise ValueError("no timed steps to summarize")
    ready = []
    for index in range(len(steps[0].ready_s)):
        values = [step.ready_s[index] for step in steps]
        if any(value is None for value in values):
            raise ValueError(f"parameter {index} got no gradient in a timed step")
        ready.append(statistics.median(v for v in values if v is not None))
    return {"forward_s": statistics.median(s.forward_s for s in steps),
            "backward_s": statistics.median(s.backward_s for s in steps),
            "optimizer_s": statistics.median(s.optimizer_s for s in steps),
            "step_s": statistics.median(s.step_s for s in steps), "ready_s": ready}


def cuda_step_times(elapsed_ms: Callable[[Any, Any], float], marks: dict[str, Any],
                    ready_events: Sequence[Any]) -> StepTimes:
    """A CUDA step's :class:`StepTimes` from its events (read after a synchronize):
    ``marks`` holds the events recorded before forward, before backward, after backward and
    after the optimizer step (``start``, ``backward``, ``backward_end``, ``end``);
    ``ready_events[i]`` the one recorded in parameter i's gradient hook (None: no gradient).
    ``elapsed_ms(a, b)`` is ``a.elapsed_time(b)`` (milliseconds, as CUDA events give them)."""
    def seconds(a: Any, b: Any) -> float:
        return elapsed_ms(a, b) / 1e3
    return StepTimes(forward_s=seconds(marks["start"], marks["backward"]),
                     backward_s=seconds(marks["backward"], marks["backward_end"]),
                     optimizer_s=seconds(marks["backward_end"], marks["end"]),
                     ready_s=[None if event is None else seconds(marks["backward"], event)
                              for event in ready_events])


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch
        return str(torch.cuda.get_device_name())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def record(model_name: str, device: str = "cpu", batch_size: int = 4, image_size: int = 224,
           steps: int = 5, warmup: int = 2, num_classes: int = 1000,
           progress: Callable[[str], None] | None = None) -> Profile:
    """Train ``model_name`` on synthetic data for ``warmup`` untimed and ``steps`` timed
    steps (SGD, as `bench` does) and return the medians as a :class:`Profile`.

    On CPU the clock is ``time.perf_counter()`` read in each parameter's post-accumulate
    hook; on CUDA the host runs ahead of the GPU, so each hook records a CUDA event on the
    current stream instead, and the times are read from the events after the step's
    synchronize (:func:`cuda_step_times`)."""
    import torch
    import torch.nn.functional as F

    from .models import build
    progress = progress or (lambda message: None)
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here "
                          f"(torch {torch.__version__}); record with --device cpu, or on a GPU")
    where = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = build(model_name, num_classes).to(where)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    named = list(model.named_parameters())
    data = torch.randn(batch_size, 3, image_size, image_size, device=where)
    target = torch.randint(0, num_classes, (batch_size,), device=where)
    ready: list[Any] = [None] * len(named)
    clock = {"backward": 0.0}

    def hook_of(index: int) -> Callable[[Any], None]:
        def hook(_: Any) -> None:
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                ready[index] = event
            else:
                ready[index] = time.perf_counter() - clock["backward"]
        return hook

    handles = [param.register_post_accumulate_grad_hook(hook_of(i))
               for i, (_, param) in enumerate(named)]

    def step() -> StepTimes:
        ready[:] = [None] * len(named)
        optimizer.zero_grad()
        if cuda:
            marks = {key: torch.cuda.Event(enable_timing=True)
                     for key in ("start", "backward", "backward_end", "end")}
            marks["start"].record()
            loss = F.cross_entropy(model(data), target)
            marks["backward"].record()
            loss.backward()
            marks["backward_end"].record()
            optimizer.step()
            marks["end"].record()
            torch.cuda.synchronize()
            return cuda_step_times(lambda a, b: a.elapsed_time(b), marks, list(ready))
        start = time.perf_counter()
        loss = F.cross_entropy(model(data), target)
        clock["backward"] = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        return StepTimes(forward_s=clock["backward"] - start,
                         backward_s=backward_end - clock["backward"],
                         optimizer_s=end - backward_end, ready_s=list(ready))

    timed = []
    try:
        for i in range(warmup):
            progress(f"warm-up step {i + 1} of {warmup}")
            step()
        for i in range(steps):
            progress(f"timed step {i + 1} of {steps}")
            timed.append(step())
    except (ValueError, RuntimeError) as exc:
        # torch's word on a batch it cannot train (BatchNorm over one value, out of memory)
        raise ConfigError(f"bpsctl profile {model_name}: batch {batch_size} of {image_size}x"
                          f"{image_size} images cannot be trained on {device}: {exc}") from None
    finally:
        for handle in handles:
            handle.remove()
    try:
        medians = summarize(timed)
    except ValueError as exc:
        raise ConfigError(f"bpsctl profile {model_name}: {exc}") from None
    parameters = tuple(ParameterTiming(name=name, shape=tuple(param.shape),
                                       dtype=str(param.dtype).removeprefix("torch."),
                                       ready_s=offset)
                       for (name, param), offset in zip(named, medians["ready_s"], strict=True))
    return Profile(model=model_name, device=device, device_name=_device_name(device),
                   torch_version=torch.__version__, batch_size=batch_size,
                   image_size=image_size, num_classes=num_classes,
                   forward_s=medians["forward_s"], backward_s=medians["backward_s"],
                   optimizer_s=medians["optimizer_s"], step_s=medians["step_s"],
                   parameters=parameters, steps=steps, warmup=warmup,
                   threads=0 if cuda else torch.get_num_threads(),
                   recorded_at=datetime.datetime.now(datetime.timezone.utc)
                   .strftime("%Y-%m-%dT%H:%M:%SZ"))


def derive(base: Profile, base_name: str, device_name: str, forward_backward_s: float,
           step_s: float, batch_size: int, image_size: int, measured: str) -> Profile:
    """``base``'s forward and backward, in the same fractions of its forward + backward
    (each parameter's ready offset included), scaled to ``forward_backward_s``; the
    optimizer step takes what is left of ``step_s``. A labelled estimate, not a recording:
    ``measured`` says where the step times come from, and the profile says it was derived."""
    if not 0 < forward_backward_s <= step_s:
        raise ValueError("expected 0 < forward_backward_s <= step_s")
    scale = forward_backward_s / (base.forward_s + base.backward_s)
    return dataclasses.replace(
        base, device="cuda", device_name=device_name,
        torch_version=f"{base.torch_version} (of {base_name}'s recording)",
        batch_size=batch_size, image_size=image_size,
        forward_s=base.forward_s * scale, backward_s=base.backward_s * scale,
        optimizer_s=step_s - forward_backward_s, step_s=step_s,
        parameters=tuple(dataclasses.replace(p, ready_s=p.ready_s * scale)
                         for p in base.parameters),
        steps=0, warmup=0, threads=0, source="derived", derived_from=base_name,
        note=(f"not recorded on this device: {base_name}'s forward, backward and per-parameter "
              f"ready times ({base.device_name}, batch {base.batch_size}, "
              f"{base.image_size}x{base.image_size}) as fractions of its forward + backward, "
              f"scaled to {forward_backward_s * 1e3:.1f} ms forward + backward and "
              f"{step_s * 1e3:.1f} ms per step (the optimizer step takes the rest) at batch "
              f"{batch_size}, {image_size}x{image_size}, as {measured}"))


# --------------------------------------------------------------------------- replay

@dataclass(frozen=True)
class ReplaySchedule:
    """A profile as the stand-in replays it, dilated: the forward pass's seconds, the
    parameters in the order their gradients become ready (index into the profile's
    parameters, offset from the start of backward), the whole backward pass's seconds (at
    least the last offset) and the optimizer step's."""

    forward_s: float
    ready: tuple[tuple[int, float], ...]
    backward_s: float
    optimizer_s: float

    @property
    def forward_shares(self) -> tuple[float, ...]:
        """The forward pass's seconds split over the parameters, by index (see
        :func:`forward_shares`)."""
        return forward_shares(self.ready, self.forward_s)


def replay_schedule(profile: Profile, dilation: float = 1.0) -> ReplaySchedule:
    """Every recorded time times ``dilation``; gradients in the order they became ready
    (parameters ready at the same moment in reverse registration order, as backward
    reaches the last layers first)."""
    if not dilation > 0:
        raise ValueError(f"dilation: expected a factor above 0, got {dilation!r}")
    count = len(profile.parameters)
    order = sorted(range(count), key=lambda i: (profile.parameters[i].ready_s, count - i))
    ready = tuple((i, profile.parameters[i].ready_s * dilation) for i in order)
    last = ready[-1][1] if ready else 0.0
    return ReplaySchedule(forward_s=profile.forward_s * dilation, ready=ready,
                          backward_s=max(profile.backward_s * dilation, last),
                          optimizer_s=profile.optimizer_s * dilation)


def forward_shares(ready: tuple[tuple[int, float], ...], forward_s: float) -> tuple[float, ...]:
    """``forward_s`` split over the parameters (by index) in proportion to the backward time
    before each one's gradient became ready (``ready``: every parameter's index and offset, in
    the order they became ready): a profile times the forward pass whole, and a layer's
    backward, like its forward, grows with its arithmetic, so its gap in backward stands for
    its share of forward. Parameters ready at the same moment as the one before (a layer's
    bias beside its weight) get nothing of their own. No gap at all: equal shares."""
    count = len(ready)
    gaps = [0.0] * count
    previous = 0.0
    for index, offset in ready:
        gaps[index] = max(offset - previous, 0.0)
        previous = max(previous, offset)
    total = sum(gaps)
    if not total:
        return tuple(forward_s / count for _ in range(count)) if count else ()
    return tuple(forward_s * gap / total for gap in gaps)


def dilation_factor(target_mbit: float | None, nic_mbit: float | None) -> float:
    """How much slower than recorded a replay runs so that the emulated NIC ``nic_mbit``
    stands for ``target_mbit``: their ratio (25 Gbit at 500 Mbit: 50). No target: 1.
    ConfigError without an emulated NIC rate to dilate against."""
    if target_mbit is None:
        return 1.0
    if not nic_mbit:
        raise ConfigError("--target-nic: the replay is dilated by the target's rate over the "
                          "emulated NIC's, and no NIC rate is set; add --emulate --nic RATE "
                          "(e.g. --nic 500mbit)")
    return target_mbit / nic_mbit


def dilated_host_cpu(target_cpu: float, dilation: float) -> float:
    """The share of one of this machine's CPUs an emulated worker host gets to stand for a
    target host whose communication has ``target_cpu`` of these cores, in a replay
    ``dilation`` times slower than recorded: ``target_cpu / dilation`` (6 cores at x125:
    0.048). Dilation slows the network and the recorded compute; this slows the systems' own
    CPU work (each message's cost) alike. ConfigError where a cgroup cannot give so little."""
    if not target_cpu > 0:
        raise ConfigError(f"--target-cpu: expected the cores each worker host gives the "
                          f"communication (e.g. 6), got {target_cpu:g}")
    share = target_cpu / dilation
    if share < MIN_HOST_CPU:
        raise ConfigError(f"--target-cpu {target_cpu:g}: at x{dilation:g} dilation each worker "
                          f"host would get {share:.3g} of a CPU, under the {MIN_HOST_CPU:g} a "
                          "cgroup gives; give more cores or a faster --nic (less dilation)")
    return share


#: what the emulated hosts' NICs may move together, per CPU core of this machine, before a
#: replay's steps are the CPU's and no longer the network's: every byte crosses the kernel's
#: emulated links and the systems' own processes on these cores (docs/replay.md has the
#: measurements it comes from).
REPLAY_MBIT_PER_CORE = 3200
#: the NIC rates a replay chooses among, fastest first
REPLAY_NIC_LADDER_MBIT = (1000, 500, 400, 250, 200, 100, 50, 25, 10)


def _replay_budget_mbit(cores: int) -> float:
    return REPLAY_MBIT_PER_CORE * max(1, cores)


def replay_nic_mbit(hosts: int, cores: int) -> float:
    """The fastest NIC rate of :data:`REPLAY_NIC_LADDER_MBIT` at which ``hosts`` emulated
    hosts stay within :data:`REPLAY_MBIT_PER_CORE` per core of ``cores`` (the slowest rate
    when none does)."""
    return next((rate for rate in REPLAY_NIC_LADDER_MBIT
                 if hosts * rate <= _replay_budget_mbit(cores)), REPLAY_NIC_LADDER_MBIT[-1])


def rate_flag(mbit: float) -> str:
    """A NIC rate as --nic takes it: "1gbit", "200mbit"."""
    return f"{mbit / 1000:g}gbit" if mbit >= 1000 and mbit % 1000 == 0 else f"{mbit:g}mbit"


def replay_fit_note(hosts: int, cores: int, nic_mbit: float, target_mbit: float) -> str:
    """A note when ``hosts`` emulated hosts at ``nic_mbit`` each could move more than this
    machine's ``cores`` keep up with in a replay (:data:`REPLAY_MBIT_PER_CORE`), naming the
    rate that fits and its dilation; "" when they fit."""
    if hosts * nic_mbit <= _replay_budget_mbit(cores):
        return ""
    fits = replay_nic_mbit(hosts, cores)
    return (f"{hosts} emulated hosts at {_rate(nic_mbit)} each may move "
            f"{_rate(hosts * nic_mbit)}/s through this machine's {cores} CPU cores, more than "
            f"the {_rate(_replay_budget_mbit(cores))}/s a replay keeps up with here: "
            f"the replayed steps may be the CPU's, not the network's. --nic "
            f"{rate_flag(fits)} (x{target_mbit / fits:g} for {_rate(target_mbit)}) keeps them "
            "apart")


#: a replay's resident memory on this machine (measured: docs/replay.md): a worker process is
#: torch's own and about 3 copies of the model's bytes (its parameters and gradients, and the
#: system's buffers: DDP's buckets, Horovod's fusion buffer), a server about 3 copies of its
#: share of them, and the command and scheduler a little more
WORKER_BASE_MIB, WORKER_MODEL_COPIES = 300, 3.0
SERVER_BASE_MIB, SERVER_SHARE_COPIES = 50, 3.1
JOB_BASE_MIB = 300


def replay_memory_mib(model_bytes: int, workers: int, servers: int) -> float:
    """About how much memory ``workers`` workers and ``servers`` servers replaying a model of
    ``model_bytes`` take on one machine, MiB (one system runs at a time)."""
    model = model_bytes / 2**20
    return (JOB_BASE_MIB + workers * (WORKER_BASE_MIB + WORKER_MODEL_COPIES * model)
            + servers * SERVER_BASE_MIB + SERVER_SHARE_COPIES * model)


def replay_memory_note(model_bytes: int, workers: int, servers: int,
                       available_mib: float) -> str:
    """A note when the replay would take more memory than ``available_mib``; "" when it
    fits."""
    need = replay_memory_mib(model_bytes, workers, servers)
    if need <= available_mib:
        return ""
    each = WORKER_BASE_MIB + WORKER_MODEL_COPIES * model_bytes / 2**20
    return (f"{workers} workers and {servers} servers replaying a model of "
            f"{model_bytes / 2**20:.0f} MiB need about {need / 1024:.1f} GiB of memory here "
            f"(each worker about {each / 1024:.1f} GiB: torch and copies of the model), and "
            f"{available_mib / 1024:.1f} GiB are available: the run may be killed for memory; "
            "run fewer workers")


def _rate(mbit: float) -> str:
    return f"{mbit / 1e3:g} Gbit" if mbit >= 1e3 else f"{mbit:g} Mbit"


def replay_label(name: str, dilation: float, target_mbit: float | None,
                 nic_mbit: float | None, target_cpu: float | None = None) -> str:
    """What a replayed report says of its times, e.g. "replayed from h200-vgg16, x50
    dilation: 25 Gbit emulated at 500 Mbit" (with ``target_cpu``: ", 6 cores a worker host at
    0.12 of a CPU")."""
    if target_mbit is None or nic_mbit is None or dilation == 1.0:
        return f"replayed from {name}, in real time"
    return (f"replayed from {name}, x{dilation:g} dilation: {_rate(target_mbit)} emulated at "
            f"{_rate(nic_mbit)}{host_cpu_label(target_cpu, dilation)}")


def host_cpu_label(target_cpu: float | None, dilation: float) -> str:
    """What a replay (bench's, tune's) says of ``--target-cpu``: ", 6 cores a worker host at
    0.048 of a CPU" (x125); "" without it."""
    if target_cpu is None:
        return ""
    return f", {target_cpu:g} cores a worker host at {target_cpu / dilation:.3g} of a CPU"


#: a train result's keys that are rates (img/sec): multiplied by the dilation; and times
#: (seconds): divided by it
_RATE_KEYS = ("img_per_sec_per_worker", "img_per_sec_per_worker_ci95", "img_per_sec",
              "img_per_sec_ci95")
_TIME_KEYS = ("step_seconds", "ideal_step_s")


def undilate_row(row: dict[str, Any], dilation: float) -> dict[str, Any]:
    """A training result measured in dilated time, in the target's time: img/sec times
    ``dilation``, seconds divided by it (the NIC fraction and the scaling are ratios, and
    bytes are bytes: unchanged). The emulated figures stay under ``emulated``."""
    if dilation == 1.0:
        return row
    out = dict(row)
    out["emulated"] = {key: row[key] for key in (*_RATE_KEYS, *_TIME_KEYS, "img_secs_per_worker",
                                                 "img_per_sec_by_rank", "img_per_sec_by_round",
                                                 "phase_seconds_per_step") if key in row}
    for key in _RATE_KEYS:
        if row.get(key) is not None:
            out[key] = row[key] * dilation
    for key in _TIME_KEYS:
        if row.get(key) is not None:
            out[key] = row[key] / dilation
    for key in ("img_secs_per_worker", "img_per_sec_by_rank", "img_per_sec_by_round"):
        if row.get(key) is not None:
            out[key] = [value * dilation for value in row[key]]
    if isinstance(row.get("phase_seconds_per_step"), dict):
        out["phase_seconds_per_step"] = {phase: seconds / dilation for phase, seconds
                                         in row["phase_seconds_per_step"].items()}
    return out


# --------------------------------------------------------------------------- the step model

#: bytes per element of each profile dtype
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
#: torch DDP's gradient buckets, filled in reverse registration order: a first small one, so
#: that communication starts early, then 25 MiB each (``bucket_cap_mb``)
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20


def transfer_groups(profile: Profile, system: str) -> list[tuple[float, float]]:
    """What ``system`` sends of one step, in the order it goes: (seconds from the start of
    backward when the group may leave, its share of the step's bytes).

    bpsctl pushes each tensor as soon as it is ready (in partitions, earlier layers first
    among those waiting) and Horovod fuses whatever is ready at each cycle (a millisecond):
    per tensor, at its ready time, for both. DDP allreduces a bucket once its last gradient
    is ready, buckets in the order it filled them (reverse registration)."""
    sizes = [p.nbytes for p in profile.parameters]
    total = sum(sizes) or 1
    if system not in ("ddp", "ddp-powersgd"):
        return sorted((p.ready_s, size / total)
                      for p, size in zip(profile.parameters, sizes, strict=True))
    groups: list[tuple[float, float]] = []
    ready, filled, cap = 0.0, 0, DDP_FIRST_BUCKET_BYTES
    for p, size in reversed(list(zip(profile.parameters, sizes, strict=True))):
        ready, filled = max(ready, p.ready_s), filled + size
        if filled >= cap:
            groups.append((ready, filled / total))
            ready, filled, cap = 0.0, 0, DDP_BUCKET_BYTES
    if filled:
        groups.append((ready, filled / total))
    return groups


def round_latency_s(piece_bytes: int, workers: int, servers: int, nic_mbit: float) -> float:
    """What a step through servers adds past its transfer, in seconds, for partitions of up
    to ``piece_bytes`` over NICs of ``nic_mbit``: a round's sum leaves its server only once
    all ``workers`` pushes of it are in, and each worker's uplink carries its pushes to all
    ``servers`` at once, so the first sums come back after about max(servers, workers)
    pieces' time on a NIC (the downlink idles meanwhile); the last sum leaves after the last
    push and reaches the workers one piece each through its server's NIC: ``workers`` pieces'
    time more. bpsctl.engine.partition.piece_bytes keeps pieces small for this, down to
    its floor."""
    return (max(servers, workers) + workers) * piece_bytes * 8 / (nic_mbit * 1e6)


def predicted_step_s(profile: Profile, system: str, network_s: float | None,
                     round_s: float = 0.0, cross_barrier: bool = False) -> float:
    """The step the model predicts for ``system`` when moving a whole step's bytes over the
    busiest NIC takes ``network_s`` (the NIC-bound ideal, in the profile's time; None or 0:
    nothing crosses a NIC): the forward pass, then backward with the network moving each of
    :func:`transfer_groups` from when it may leave, one after another at that rate, and
    ``round_s`` more for a step through servers (:func:`round_latency_s`), then the optimizer
    step once both have ended. With ``cross_barrier`` (bpsctl's CrossBarrier) the next
    forward pass starts when backward ends and runs while the transfer finishes, each layer
    once its update is in: the step is the longer of the compute (forward and backward) and
    the transfer, then the optimizer step (the layers that wait for the last sums, and their
    forward after them, are not counted). What it leaves out: the CPU time of the systems
    themselves, and a ring's latency per message."""
    network_s = network_s or 0.0
    done = 0.0                  # when the network is free, from the start of backward
    for ready_s, share in transfer_groups(profile, system):
        done = max(done, ready_s) + share * network_s
    if network_s:
        done += round_s
    backward_s = max([profile.backward_s] + [p.ready_s for p in profile.parameters])
    if cross_barrier:
        return max(profile.forward_s + backward_s, done) + profile.optimizer_s
    return profile.forward_s + max(backward_s, done) + profile.optimizer_s
