"""`bpsctl tune` as functions: search partition size, server count, credit and the layout on
one cluster.

One cluster serves the whole search: partition size, credit, the number of servers a job
uses and the layout's split of the bytes are all chosen per job (the scheduler takes the first
worker's ``partition_bytes``, ``num_servers`` and ``cpu_share``; credit is the workers' own),
so each point is a fresh job — new worker processes — on the same scheduler and servers, and
an emulated cluster is built once. The layout is searched on a cluster whose servers sit on
worker hosts and on CPU-only hosts at once (`up --emulate --colocated-servers --servers K`,
or such a hosts file): ``cpu_share``, the part of the bytes the CPU hosts' servers sum, from 0
(servers on the worker hosts only) to 1 (the CPU hosts only) around the traffic model's
optimum, which goes first; there the job uses all its servers (which ones are first depends
on the order they registered in, so a server count would mean no particular hosts).

Each point is scored by the comm benchmark (push_pull algbw of a fixed gradient size, median of
the timed rounds) or a training benchmark (img/sec), which may replay a recorded GPU step
(``replay``, docs/replay.md): then the knobs are tuned for that device's compute-to-network
ratio, on emulated hosts dilated to the target NIC (``target_nic_mbit``). optuna's TPE sampler,
seeded, picks the points; the model's server guess and the current config's nearest point go
first. The best few and the current config are then measured again in interleaved passes (a
burst of load on the machine hits them all alike), and the best median over those passes wins:
neither one lucky measurement nor the search's own (selection-biased) scores decide.
"""
from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import launch
from ..bench.api import BenchError, CommSettings, bench_cluster, comm_point, ssh_cluster
from ..bench.profile import dilation_factor, host_cpu_label, rate_flag, undilate_row
from ..bench.training import TrainSettings, train_system
from ..config import Config, ConfigError, format_bytes
from ..model import ServerGuess, guess_servers, plan_layout

KNOBS = ("partition_bytes", "servers", "credit", "layout")
#: 64 KiB .. 64 MiB, ×4 steps
PARTITION_SIZES = tuple(64 * 1024 * 4**i for i in range(6))
#: credit as a multiple of the partition size: how many partitions a worker keeps in flight
CREDIT_MULTIPLES = (2, 8, 32)


@dataclass(frozen=True)
class TuneSettings:
    knobs: tuple[str, ...] = KNOBS       # what to search; the others stay at the config's value
    trials: int = 16                     # points the search measures (the grid: all of them)
    grid: bool = False                   # measure every point instead of searching
    model: str | None = None             # score on this training benchmark, not comm
    replay: str = ""                     # with model: train the stand-in of this profile
    target_nic_mbit: float | None = None  # with replay: the NIC the emulated one stands for
    target_cpu: float | None = None      # with target_nic_mbit: a worker host's cores (dilated)
    workers: int | None = None           # None: one per emulated worker host of a live
                                         # cluster, else 2
    servers: int | None = None           # servers of a private cluster (None: as many as workers)
    size_bytes: int = 32 * 1024 * 1024   # comm: bytes each worker push_pulls per round
    tensors: int = 8
    warmup: int = 2
    repeats: int = 5
    finalists: int = 3
    final_passes: int = 3                # re-measurements of each finalist, interleaved
    seed: int = 0
    partition_sizes: tuple[int, ...] = PARTITION_SIZES
    credit_multiples: tuple[int, ...] = CREDIT_MULTIPLES

    def __post_init__(self) -> None:
        unknown = [k for k in self.knobs if k not in KNOBS]
        if unknown or not self.knobs:
            raise ConfigError(f"tune: knobs to tune are {', '.join(KNOBS)}, got {self.knobs}")
        for name, value, least in (("--trials", self.trials, 1), ("--repeats", self.repeats, 1),
                                   ("--finalists", self.finalists, 1),
                                   ("--final-passes", self.final_passes, 1),
                                   ("--tensors", self.tensors, 1)):
            if value < least:
                raise ConfigError(f"{name}: expected at least {least}, got {value}")
        if self.model is not None and self.warmup < 1:
            raise ConfigError("--warmup: expected at least 1 with --model (the warm-up declares "
                              "every tensor before timing)")
        if self.replay or self.target_nic_mbit is not None:
            self.training()         # the profile checked before any cluster starts
        if self.model is None and self.size_bytes < 4 * self.tensors:
            raise ConfigError(f"--size: {self.size_bytes} bytes is too small for {self.tensors} "
                              f"float32 tensors (at least {4 * self.tensors} bytes)")

    def training(self, workers: int = 2, servers: int = 2, iters: int = 1) -> TrainSettings:
        """The training benchmark a point runs (``model`` must be set): the replay's at the
        profile's batch and image size."""
        if self.model is None:
            raise ConfigError("--replay: tune scores a replay by training; add --model and the "
                              "profile's model (e.g. --model resnet50 --replay h200-resnet50)"
                              if self.replay else "--target-nic: only a replay can be dilated "
                              "to another NIC's time; add --model MODEL --replay PROFILE")
        shape: dict[str, Any] = {}
        if self.replay:
            from ..bench.profile import load
            profile = load(self.replay)
            shape = {"batch_size": profile.batch_size, "image_size": profile.image_size}
        return TrainSettings(model=self.model, workers=workers, servers=servers,
                             warmup=self.warmup, iters=iters, replay=self.replay,
                             target_nic_mbit=self.target_nic_mbit, target_cpu=self.target_cpu,
                             **shape)


@dataclass(frozen=True)
class Point:
    partition_bytes: int
    servers: int
    credit_bytes: int
    cpu_share: float | None = None      # BPSCTL_CPU_SHARE of the job (None: the cluster's)


@dataclass(frozen=True)
class Space:
    """The points a search may choose: every combination of these values."""

    partitions: tuple[int, ...]
    servers: tuple[int, ...]
    credit_multiples: tuple[int, ...] | None      # None: credit fixed at ``credit_bytes``
    credit_bytes: int
    cpu_shares: tuple[float | None, ...] = (None,)   # None: the config's BPSCTL_CPU_SHARE

    @classmethod
    def build(cls, config: Config, settings: TuneSettings, cluster_servers: int,
              layout_choices: tuple[float, ...] = ()) -> Space:
        """``layout_choices``: the cpu_share values to search (:func:`layout_choices`), none
        on a cluster without servers of both kinds; when searched, jobs use every server."""
        current_servers = min(config.num_servers or cluster_servers, cluster_servers)
        layout = "layout" in settings.knobs and bool(layout_choices)
        return cls(
            partitions=(settings.partition_sizes if "partition_bytes" in settings.knobs
                        else (config.partition_bytes,)),
            servers=((cluster_servers,) if layout else
                     tuple(range(1, cluster_servers + 1)) if "servers" in settings.knobs
                     else (current_servers,)),
            credit_multiples=settings.credit_multiples if "credit" in settings.knobs else None,
            credit_bytes=config.credit_bytes,
            cpu_shares=layout_choices if layout else (config.cpu_share_value,))

    @property
    def credits(self) -> tuple[int | None, ...]:
        return self.credit_multiples or (None,)

    def point(self, partition_index: int, servers_index: int, credit_index: int,
              layout_index: int = 0) -> Point:
        partition = self.partitions[partition_index]
        multiple = self.credits[credit_index]
        return Point(partition, self.servers[servers_index],
                     self.credit_bytes if multiple is None else multiple * partition,
                     self.cpu_shares[layout_index])

    def __len__(self) -> int:
        return (len(self.partitions) * len(self.servers) * len(self.credits)
                * len(self.cpu_shares))

    def __iter__(self) -> Iterator[Point]:
        for p in range(len(self.partitions)):
            for s in range(len(self.servers)):
                for c in range(len(self.credits)):
                    for lay in range(len(self.cpu_shares)):
                        yield self.point(p, s, c, lay)

    def nearest(self, partition_bytes: int, servers: int, credit_bytes: int,
                cpu_share: float | None = None) -> dict[str, int]:
        """Indices of the point closest (on the log scales) to the given values."""
        def closest(values: tuple[Any, ...], target: float) -> int:
            return min(range(len(values)), key=lambda i: (abs(math.log(values[i] / target)), i))
        credit_ratio = credit_bytes / partition_bytes
        return {"partition": closest(self.partitions, partition_bytes),
                "servers": min(range(len(self.servers)),
                               key=lambda i: (abs(self.servers[i] - servers), i)),
                "credit": 0 if self.credit_multiples is None
                else closest(self.credit_multiples, credit_ratio),
                "layout": 0 if cpu_share is None or None in self.cpu_shares
                else min(range(len(self.cpu_shares)),
                         key=lambda i: (abs((self.cpu_shares[i] or 0) - cpu_share), i))}


def layout_choices(model_share: float) -> tuple[float, ...]:
    """The cpu_share values tune measures around the model's optimum ``model_share``: the two
    pure layouts (0: servers on the worker hosts only; 1: the CPU hosts only), the optimum, and
    half-way to each end (the model leaves out the CPUs' and the workers' own costs, which
    measurement finds)."""
    return tuple(sorted({0.0, round(model_share / 2, 4), round(model_share, 4),
                         round((model_share + 1) / 2, 4), 1.0}))


@dataclass
class Tuning:
    """What one tuning run measured; :meth:`report` is the JSON of docs/design.md."""

    settings: TuneSettings
    space: Space
    workers: int
    cluster_servers: int
    nic_mbit: float | None
    cluster: str                         # a description of what was measured, for the file
    score_unit: str
    baseline: Point
    guess: ServerGuess | None
    guess_note: str
    #: the traffic model's layout on a cluster with servers of both kinds: {"cpu_share",
    #: "round_factor" (units of S/R), "round_seconds" (of the comm size; null without a NIC)}
    layout_model: dict[str, Any] | None = None
    trials: list[dict[str, Any]] = field(default_factory=list)
    #: the re-measured points (finalists and the current config): median over the passes
    finalists: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    #: the chosen point of a mixed layout measured again with pacing off (BPSCTL_PACING=0):
    #: {"score", "passes"}; None where pacing does not apply
    unpaced: dict[str, Any] | None = None
    #: the share of a CPU every emulated worker host had (BPSCTL_HOST_CPU); None: unlimited
    host_cpu: float | None = None

    def report(self) -> dict[str, Any]:
        base = next((f for f in self.finalists if f["current"]), None)
        return {
            "kind": "tune", "mode": "grid" if self.settings.grid else "tpe",
            "knobs": self.searched(), "score_unit": self.score_unit,
            "benchmark": self.benchmark(), "workers": self.workers,
            "servers": self.cluster_servers, "nic_mbit": self.nic_mbit, "cluster": self.cluster,
            "space_points": len(self.space),
            "measurements": len(self.trials),
            "timed_rounds": sum(t["repeats"] for t in self.trials),
            "trials": self.trials, "finalists": self.finalists, "best": self.best,
            "baseline": base,
            "improvement": (self.best["score"] / base["score"]) if base and self.best else None,
            "model_guess": None if self.guess is None else {
                "servers": self.guess.servers, "round_seconds": self.guess.round_seconds,
                "why": self.guess.why},
            "model_note": self.guess_note,
            "model_layout": self.layout_model,
            "unpaced": self.unpaced,
            "host_cpu": self.host_cpu,
        }

    def searched(self) -> list[str]:
        """The knobs asked for that this cluster lets tune search: the layout only where
        servers sit on worker hosts and on CPU-only hosts, and then not the server count."""
        layout = None not in self.space.cpu_shares
        return [k for k in self.settings.knobs
                if (k != "layout" or layout) and (k != "servers" or not layout)]

    def benchmark(self) -> str:
        s = self.settings
        if s.model:
            replayed = ""
            if s.replay:
                replayed = f" replaying {s.replay}"
                if s.target_nic_mbit is not None:   # and a NIC rate to dilate (_tune_on)
                    dilation = dilation_factor(s.target_nic_mbit, self.nic_mbit)
                    replayed += (f" (img/sec in the time of a {rate_flag(s.target_nic_mbit)} "
                                 f"NIC{host_cpu_label(s.target_cpu, dilation)})")
            return (f"bench {s.model}{replayed}: img/sec, {s.warmup} warm-up + {s.repeats} "
                    "timed iterations")
        return (f"bench comm: push_pull of {s.size_bytes} bytes in {s.tensors} tensors, "
                f"algbw of the median of {s.repeats} rounds after {s.warmup} warm-up")


Progress = Callable[[int, int, str], None]


def paced(point_share: float | None, layout_model: dict[str, Any] | None,
          config: Config) -> bool:
    """Whether a job at a point whose CPU hosts' share is ``point_share`` (None: the cluster's
    layout) is paced (engine/pacing.py): servers of both kinds summing unequal shares, and
    pacing on. 0 and 1 leave one kind of server summing everything, evenly."""
    return config.pacing and layout_model is not None and \
        (point_share is None or 0.0 < point_share < 1.0)


def _measure(config: Config, point: Point, settings: TuneSettings, workers: int,
             nic_mbit: float | None, repeats: int, output: Any,
             pacing: bool = True) -> tuple[float, float]:
    """(score, seconds) of one fresh job at ``point``: higher score is better."""
    job_config = config.replace(partition_bytes=point.partition_bytes,
                                credit_bytes=point.credit_bytes, pacing=config.pacing and pacing,
                                cpu_share=config.cpu_share if point.cpu_share is None
                                else repr(point.cpu_share))
    if settings.model is None:
        comm = CommSettings(workers=workers, servers=point.servers, sizes=(settings.size_bytes,),
                            tensors=settings.tensors, warmup=settings.warmup, repeats=repeats,
                            raw=False)
        row = comm_point(job_config, comm, settings.size_bytes, nic_mbit, output)["results"][0]
        return row["algbw_MBps"], row["seconds"]
    train = settings.training(workers, point.servers, repeats)
    dilation = dilation_factor(settings.target_nic_mbit, nic_mbit)
    row = undilate_row(train_system(job_config, train, "bpsctl", output, dilation), dilation)
    return row["img_per_sec"], row["step_seconds"]


def _cluster_facts(config: Config, settings: TuneSettings, nic_mbit: float | None
                   ) -> tuple[int, list[str], list[str] | None, str]:
    """(workers, server hosts in job order, worker host of each rank or None, description)."""
    ssh = ssh_cluster(config.state_dir)
    if ssh is not None and ssh.hosts:   # its hosts file says it all; the NIC is unknown
        slots = launch.worker_slots(ssh)
        server_hosts = [p.host for p in ssh.processes if p.role == "server"]
        return (len(slots), server_hosts, None,
                f"SSH cluster of {ssh.hosts.source}: {len(slots)} workers on "
                f"{', '.join(dict.fromkeys(a.address for a in slots))}, "
                f"{len(server_hosts)} servers on {', '.join(dict.fromkeys(server_hosts))}")
    state = launch.load_state(config.state_dir)
    if state is None:
        raise BenchError(f"no cluster recorded in {config.state_dir}")
    server_hosts = [p.host for p in sorted((p for p in state.processes if p.role == "server"),
                                           key=lambda p: p.rank)]
    emulated = state.emulation["workers"] if state.emulation else None
    workers = settings.workers or (len(emulated) if emulated else 2)
    worker_hosts = ([slot.address for slot in launch.worker_slots(state, workers)]
                    if emulated else None)
    if emulated:
        description = (f"emulated cluster: {len(emulated)} worker hosts "
                       f"({', '.join(h['address'] for h in emulated)}), {len(server_hosts)} "
                       f"server hosts ({', '.join(server_hosts)}), NIC {nic_mbit:g} Mbit/s")
    else:
        description = f"this machine (loopback): {workers} workers, {len(server_hosts)} servers"
    return workers, server_hosts, worker_hosts, description


def run_tune(config: Config, settings: TuneSettings, progress: Progress | None = None,
             output: Any = None) -> Tuning:
    """Search ``settings.knobs`` on the cluster `bpsctl up` started, or on a private one
    (``config.emulate``: emulated). Worker output goes to ``output`` (default: discarded)."""
    progress = progress or (lambda done, total, text: None)
    sink = output if output is not None else open(os.devnull, "w")
    # an SSH cluster runs one worker per slot of its hosts file: no default to impose there
    private_workers = settings.workers or (None if ssh_cluster(config.state_dir) else 2)
    try:
        servers = settings.servers or private_workers
        if config.colocated_servers:        # the CPU hosts' (default none) and the workers'
            servers = (settings.servers or 0) + (private_workers or 0)
        with bench_cluster(config, private_workers, servers) as (
                cluster_config, nic):
            return _tune_on(cluster_config, settings, nic, progress, sink)
    finally:
        if output is None:
            sink.close()


def _layout_facts(config: Config, workers: int, size_bytes: int, nic: float | None
                  ) -> tuple[tuple[float, ...], dict[str, Any] | None]:
    """(cpu_share values to search, the model's layout) when the job's servers sit on worker
    hosts and on CPU-only hosts at once; ((), None) otherwise. The model's layout is
    bpsctl/model.py's optimum at the NIC rates the cluster recorded (equal rates otherwise)."""
    state = launch.load_state(config.state_dir)
    if state is None:
        return (), None
    hosts = [slot.address for slot in launch.worker_slots(state, workers)]
    rows = sorted((row for row in launch.status(config.state_dir)["processes"]
                   if row["role"] == "server" and row["state"] == "running"),
                  key=lambda row: row["rank"])
    server_hosts = [row["host"] for row in rows]
    colocated = [host in hosts for host in server_hosts]
    if all(colocated) or not any(colocated):
        return (), None
    rates = (state.layout or {}).get("rates_mbit") or {}
    model = plan_layout(hosts, server_hosts, rates_mbit=rates)
    cpu_share = sum(share for share, on_worker in zip(model.shares, colocated, strict=True)
                    if not on_worker)
    why = (f"{len(model.colocated_hosts)} worker host(s) and {len(model.cpu_hosts)} CPU "
           f"host(s) run servers: the CPU hosts' servers sum {cpu_share:.3f} of the bytes "
           f"(modelled round {model.round_factor():.2f} S/R)")
    return layout_choices(cpu_share), {
        "cpu_share": cpu_share, "round_factor": model.round_factor(),
        "round_seconds": model.round_seconds(size_bytes, nic) if nic else None, "why": why}


def _tune_on(config: Config, settings: TuneSettings, nic: float | None, progress: Progress,
             output: Any) -> Tuning:
    dilation_factor(settings.target_nic_mbit, nic)     # an emulated NIC rate to dilate, first
    workers, server_hosts, worker_hosts, description = _cluster_facts(config, settings, nic)
    choices, layout_model = _layout_facts(config, workers, settings.size_bytes, nic)
    if settings.knobs == ("layout",) and not choices:
        raise ConfigError("tune --layout: the job's servers do not sit on worker hosts and on "
                          "CPU-only hosts at once, so there is no split to choose; tune on "
                          "`bpsctl up --emulate --colocated-servers --servers K` (or such a "
                          "hosts file), or tune other knobs")
    space = Space.build(config, settings, len(server_hosts), choices)
    guess, note = None, "loopback: no NIC to model (the servers' CPUs, not a network, bind)"
    if nic is not None and worker_hosts is not None:
        guess = guess_servers(worker_hosts, server_hosts, nic, settings.size_bytes)
        note = guess.why
    baseline = Point(config.partition_bytes, min(config.num_servers or len(server_hosts),
                                                 len(server_hosts)), config.credit_bytes,
                     config.cpu_share_value)
    tuning = Tuning(settings, space, workers, len(server_hosts), nic, description,
                    "img/sec" if settings.model else "algbw MB/s", baseline, guess, note,
                    layout_model, host_cpu=config.host_cpu or None)
    search = len(space) if settings.grid else min(settings.trials, len(space))
    total = 1 + search + settings.final_passes * (min(settings.finalists, search) + 1)
    total += settings.final_passes if layout_model is not None else 0       # unpaced, maybe
    scores: dict[Point, float] = {}

    def measure(point: Point, stage: str, pacing: bool = True) -> float:
        progress(len(tuning.trials), total, f"{stage} {_describe(point)}")
        score, seconds = _measure(config, point, settings, workers, nic, settings.repeats, output,
                                  pacing)
        tuning.trials.append({"number": len(tuning.trials), "stage": stage,
                              "partition_bytes": point.partition_bytes, "servers": point.servers,
                              "credit": point.credit_bytes, "cpu_share": point.cpu_share,
                              "score": score, "seconds": seconds, "repeats": settings.repeats})
        return score

    measure(baseline, "baseline")
    if settings.grid:
        for point in space:
            scores[point] = measure(point, "grid")
    else:
        model_share = None if layout_model is None else round(layout_model["cpu_share"], 4)
        _search(space, settings, guess, baseline, scores,
                lambda point: measure(point, "search"), search, model_share)
    leaders = sorted(scores, key=lambda p: -scores[p])[:settings.finalists]
    contenders = [*leaders, *([] if baseline in leaders else [baseline])]
    passes: dict[Point, list[float]] = {point: [] for point in contenders}
    for _ in range(settings.final_passes):
        for point in contenders:
            passes[point].append(measure(point, "final"))
    tuning.finalists = rank_finalists(passes, baseline, scores)
    best = tuning.best = tuning.finalists[0]
    winner = Point(best["partition_bytes"], best["servers"], best["credit"], best["cpu_share"])
    if paced(winner.cpu_share, layout_model, config):
        # what pacing by share gives the chosen layout: the same point with it off
        unpaced = [measure(winner, "unpaced", pacing=False) for _ in range(settings.final_passes)]
        tuning.unpaced = {"score": statistics.median(unpaced), "passes": unpaced}
    progress(len(tuning.trials), total, "done")
    return tuning


def rank_finalists(passes: dict[Point, list[float]], baseline: Point,
                   search_scores: dict[Point, float]) -> list[dict[str, Any]]:
    """The re-measured points (the search's leaders and the current config), best median of
    their passes first: the first is the choice, the current config itself when no leader beat
    it (a tuned file then keeps what was there)."""
    final = {point: statistics.median(values) for point, values in passes.items()}
    return [{"partition_bytes": p.partition_bytes, "servers": p.servers,
             "credit": p.credit_bytes, "cpu_share": p.cpu_share, "score": final[p],
             "passes": passes[p], "search_score": search_scores.get(p), "current": p == baseline}
            for p in sorted(passes, key=lambda p: -final[p])]


def _search(space: Space, settings: TuneSettings, guess: ServerGuess | None, baseline: Point,
            scores: dict[Point, float], measure: Callable[[Point], float], budget: int,
            model_share: float | None = None) -> None:
    """optuna TPE over the space's indices (ordered, so neighbours inform each other); a point
    it proposes again is answered from memory, not measured twice."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=settings.seed, multivariate=True,
                                         n_startup_trials=max(3, budget // 3))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    # a space-filling start: the current config's nearest point, then the model's server count
    # (and layout) at the smallest, a middle and the largest partition size (TPE alone, from a
    # start near the current config, can spend the whole budget on one end of the range)
    start = space.nearest(baseline.partition_bytes, baseline.servers, baseline.credit_bytes,
                          baseline.cpu_share)
    servers = (space.servers.index(guess.servers) if guess is not None
               and guess.servers in space.servers else start["servers"])
    layout = (space.cpu_shares.index(model_share) if model_share in space.cpu_shares
              else start["layout"])
    last = len(space.partitions) - 1
    seeds = [start] + [{"partition": index, "servers": servers,
                        "credit": len(space.credits) // 2, "layout": layout}
                       for index in sorted({0, last // 2, last})]
    for seed in [dict(t) for t in dict.fromkeys(tuple(sorted(d.items())) for d in seeds)]:
        study.enqueue_trial(seed)
    for _ in range(budget * 20):        # proposals, measured or remembered
        if len(scores) >= budget:
            break
        trial = study.ask()
        indices = {name: trial.suggest_int(name, 0, count - 1) for name, count in
                   (("partition", len(space.partitions)), ("servers", len(space.servers)),
                    ("credit", len(space.credits)), ("layout", len(space.cpu_shares)))}
        point = space.point(indices["partition"], indices["servers"], indices["credit"],
                            indices["layout"])
        if point not in scores:
            scores[point] = measure(point)
        study.tell(trial, scores[point])


def _describe(point: Point) -> str:
    return (f"partition {format_bytes(point.partition_bytes)}, {point.servers} server(s), "
            f"credit {format_bytes(point.credit_bytes)}"
            + ("" if point.cpu_share is None else f", CPU hosts' share {point.cpu_share:g}"))
