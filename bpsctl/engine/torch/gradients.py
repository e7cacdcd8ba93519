"""The gradient hooks: buckets of gradients pushed the moment backward has produced them
(:class:`_GradientSync`), and under asynchronous training the hooks that push them with their
hyperparameters and take the servers' parameters back (:class:`_AsyncSync`)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ... import engine as _engine
from ..fusion import Bucket as _Bucket
from ..fusion import buckets as _buckets
from ..trace import now_ns
from .compression import Compression, CompressionArg
from .ops import Hyperparameters, _start_async, push_pull_async_inplace, synchronize
from .plugin import _p
from .staleness import StaleGradients


def _member_views(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """``flat``'s slice of each of ``params`` (packed in order), shaped like it."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i in one call (on a GPU, a few kernel launches
    rather than one per tensor: a bucket's members are many and small, and the optimizer's
    step waits for their launches)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:         # an older torch
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    else:
        foreach(dst, src)


class _GradientSync:
    """Hooks that push gradients as soon as autograd has accumulated them: a bucket goes when
    the last of its gradients is ready (see :func:`_buckets`).

    ``solo`` (a job of one worker, whose averages are the gradients themselves): no hooks at
    all, so that backward runs as in plain torch; the first :meth:`synchronize` pushes every
    bucket once, which binds each name to its dtype and shape as in any job, and later ones
    only end the step."""

    def __init__(self, named_parameters: list[tuple[str, torch.nn.Parameter]], prefix: str,
                 compression: CompressionArg, passes_per_step: int,
                 before_first_push: Callable[[], None] | None = None,
                 group_of: dict | None = None, solo: bool = False, average: bool = True,
                 predivide: float = 1.0, sparse_as_dense: bool = False,
                 by_priority: bool = False):
        if passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step: expected at least 1, "
                             f"got {passes_per_step}")
        names = [name for name, _ in named_parameters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names: {duplicates}")
        self.prefix = prefix
        self.params = [p for _, p in named_parameters if p.requires_grad]
        full_names = {p: f"{prefix}.{name}" for name, p in named_parameters}
        config = _p().config
        self.buckets = _buckets(self.params, full_names, config.fusion_bytes, prefix,
                                group_of, config.cuda_fusion_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.compression = compression
        # Horovod's op=Sum (average=False), gradient_predivide_factor (gradients divided by it
        # before the sum, multiplied by it after the average: the same average, summed in a
        # range that overflows less) and sparse_as_dense
        self.average, self.predivide = average, predivide
        self.sparse_as_dense = sparse_as_dense
        self.densified: set[torch.nn.Parameter] = set()     # sparse gradients pushed dense
        self.passes_per_step = passes_per_step
        self.delay = {p: passes_per_step for p in self.params}
        self.handles: dict[_Bucket, int] = {}
        self.enabled = True
        self.before_first_push = before_first_push
        self.solo, self.checked = solo, False
        self.hooks = [] if solo else [p.register_post_accumulate_grad_hook(self._hook)
                                      for p in self.params]
        self.stale: StaleGradients | None = None    # bounded staleness: pushes from slots
        # the buckets go in the order they are ready unless a consumer takes each layer's
        # average as it arrives (CrossBarrier): see _push
        self.by_priority = by_priority
        # when this step's first and last bucket were ready (the backward span of a trace)
        self.first_ready_ns = self.last_ready_ns = 0

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        if self.delay[p] == 0:
            raise AssertionError(
                "gradients were computed more than backward_passes_per_step times before "
                "step() or synchronize(); increase backward_passes_per_step to accumulate "
                "gradients locally")
        self.delay[p] -= 1
        if self.delay[p] == 0:
            bucket = self.bucket_of[p]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self.last_ready_ns = now_ns()
                if not self.handles:
                    self.first_ready_ns = self.last_ready_ns
                    if self.before_first_push is not None:
                        self.before_first_push()
                self._push(bucket)

    def _push(self, bucket: _Bucket) -> None:
        """Push a ready bucket. A round on a server ends only when every worker's push of it
        is in, so the workers must send in one order: the order backward makes the buckets
        ready is the same on all of them, while a priority order is not. A bucket of higher
        priority ready later overtakes whatever is still queued, and with workers a few
        milliseconds apart each one is overtaken at a different point, so every server holds
        rounds that wait for one late worker while the pulls idle. The step waits for every
        average anyway, so priorities gain nothing there; only a CrossBarrier, which updates
        each layer as its average arrives, pushes by priority (``by_priority``)."""
        name, into = bucket.name, None
        if self.stale is not None:
            # this step's slot: the gradients stay there while s more steps run
            into, name = self.stale.slot_tensor(bucket)
        tensor = self.gradient(bucket, into)
        if self.predivide != 1.0:
            tensor.div_(self.predivide)             # the push_pull overwrites it anyway
        self.handles[bucket] = push_pull_async_inplace(tensor, average=self.average, name=name,
                                                       priority=bucket.priority
                                                       if self.by_priority else 0,
                                                       compression=self.compression)

    def grads(self, bucket: _Bucket) -> list[torch.Tensor]:
        """The bucket's members' gradients (a missing one becomes zeros; a sparse one dense,
        with ``sparse_as_dense``, made sparse again after the push_pull)."""
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError(f"{self.prefix}: the gradient of a parameter of shape "
                                     f"{tuple(p.shape)} is sparse; pass sparse_as_dense=True to "
                                     "DistributedOptimizer (it is pushed dense and made sparse "
                                     "again), or make the layer dense (sparse=False)")
                p.grad = p.grad.to_dense()
                self.densified.add(p)
            grads.append(p.grad)
        return grads

    def gradient(self, bucket: _Bucket, into: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's gradient as one tensor: a lone parameter's own, or its members'
        packed into the bucket's flat buffer; with ``into``, packed there (even a lone one)."""
        grads = self.grads(bucket)
        if into is None:
            if len(grads) == 1:
                return grads[0]
            if bucket.flat is None:
                first = bucket.params[0]
                bucket.flat = torch.empty(sum(p.numel() for p in bucket.params),
                                          dtype=first.dtype, device=first.device)
                bucket.views = _member_views(bucket.flat, bucket.params)
            into = bucket.flat
        torch.cat([g.reshape(-1) for g in grads], out=into)
        return into

    def synchronize(self, end_of_step: bool = True) -> None:
        """Wait for every bucket's push_pull; ``end_of_step``: the step ends here (no
        optimizer update follows that would end it)."""
        if self.solo and self.checked:
            if end_of_step:
                _engine._w().mark_step()
            return
        self.checked = True
        started_ns = now_ns()
        for bucket, handle in self.take_handles():
            synchronize(handle)
            self.unpack(bucket)
            self.rescale(bucket)
        # the wait for the averaged gradients, on the worker's timeline
        worker = _engine._w()
        worker.trace_span("synchronize", self.prefix, started_ns, now_ns())
        if end_of_step:
            worker.mark_step()

    def take_handles(self) -> list[tuple[_Bucket, int]]:
        """End the step's pushes: push every bucket not pushed yet, then hand over each
        bucket's handle (highest priority first) and reset the counts for the next step."""
        # buckets not pushed yet (a parameter unused this step, or fewer backward passes than
        # backward_passes_per_step) still take part, so every worker pushes the same tensors
        for bucket in self.buckets:
            if bucket not in self.handles:
                self._push(bucket)
        taken = sorted(self.handles.items(), key=lambda item: -item[0].priority)
        for bucket in self.buckets:
            bucket.ready = 0
        for p in self.params:
            self.delay[p] = self.passes_per_step
        self.handles.clear()
        # the backward pass (first to last gradient ready), on the worker's timeline
        if self.first_ready_ns:
            _engine._w().trace_span("backward", self.prefix, self.first_ready_ns,
                                    self.last_ready_ns)
            self.first_ready_ns = 0
        return taken

    def rescale(self, bucket: _Bucket) -> None:
        """After the bucket's push_pull is unpacked: undo the predivision, make densified
        gradients sparse again."""
        if self.predivide == 1.0 and not self.densified:
            return
        for p in bucket.params:
            if p.grad is None:
                continue
            if self.predivide != 1.0:
                p.grad.mul_(self.predivide)
            if p in self.densified:
                p.grad = p.grad.to_sparse()
                self.densified.discard(p)

    @staticmethod
    def unpack(bucket: _Bucket, flat: torch.Tensor | None = None) -> None:
        """After a fused bucket's push_pull: copy the averages back into its gradients (a lone
        gradient was averaged in place); ``flat``: from there instead of the bucket's buffer."""
        if flat is None:
            flat, views = bucket.flat, bucket.views
        else:
            views = _member_views(flat, bucket.params)
        if flat is not None:
            grads = []
            for p in bucket.params:
                if p.grad is None:          # set to None since the push (zero_grad)
                    p.grad = torch.empty_like(p)
                grads.append(p.grad)
            _copy_all(grads, views)


class _AsyncSync(_GradientSync):
    """The gradient hooks under asynchronous training: each bucket (one param group's
    parameters only) pushes its gradient with the group's hyperparameters, and its push_pull
    answers with the servers' parameters, into the parameter itself (a lone, contiguous one)
    or the bucket's parameter buffer (``unpack_params`` copies them out)."""

    def __init__(self, named_parameters: list[tuple[str, torch.nn.Parameter]], prefix: str,
                 optimizer: torch.optim.Optimizer, passes_per_step: int):
        group_of = {p: i for i, group in enumerate(optimizer.param_groups)
                    for p in group["params"]}
        super().__init__(named_parameters, prefix, Compression.none, passes_per_step,
                         group_of=group_of)
        # its groups are looked up at each push: load_state_dict (broadcast_optimizer_state)
        # replaces them, and LR schedulers change them
        self.optimizer, self.group_of = optimizer, group_of
        self.initialised = False        # the buckets' init pushes are done (the first step)
        self.param_buffers: dict[_Bucket, torch.Tensor] = {}

    def _push(self, bucket: _Bucket) -> None:
        if self.initialised:        # the first step pushes its gradients after the init pushes
            self.handles[bucket] = _start_async(self.gradient(bucket), self.params_out(bucket),
                                                bucket.name, bucket.priority,
                                                update=self.hyperparameters(bucket))

    def hyperparameters(self, bucket: _Bucket) -> Hyperparameters:
        """The bucket's param group's SGD hyperparameters now (so LR schedules apply)."""
        group = self.optimizer.param_groups[self.group_of[bucket.params[0]]]
        return (float(group["lr"]), float(group["momentum"]), float(group["weight_decay"]),
                float(group["dampening"]), bool(group["nesterov"]))

    def params_out(self, bucket: _Bucket) -> torch.Tensor:
        """Where the servers' parameters of ``bucket`` land."""
        first = bucket.params[0]
        if len(bucket.params) == 1 and first.is_contiguous():
            return first.detach()
        buffer = self.param_buffers.get(bucket)
        if buffer is None:
            buffer = self.param_buffers[bucket] = torch.empty(
                sum(p.numel() for p in bucket.params), dtype=first.dtype, device=first.device)
        return buffer

    def unpack_params(self, bucket: _Bucket) -> None:
        buffer = self.param_buffers.get(bucket)
        if buffer is not None:
            with torch.no_grad():
                _copy_all([p.detach() for p in bucket.params],
                          _member_views(buffer, bucket.params))

    def initialise(self) -> None:
        """Every bucket's init push: its parameter values; the servers answer with the first
        worker's (in practice equal: broadcast_parameters came first), copied in."""
        handles = []
        for bucket in self.buckets:
            out = self.params_out(bucket)
            if out.data_ptr() != bucket.params[0].data_ptr():
                torch.cat([p.detach().reshape(-1) for p in bucket.params], out=out)
            handles.append((bucket, _start_async(out, out, bucket.name, bucket.priority,
                                                 init=True)))
        for bucket, handle in handles:
            synchronize(handle)
            self.unpack_params(bucket)
        self.initialised = True
