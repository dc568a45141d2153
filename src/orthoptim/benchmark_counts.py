"""What one optimizer step costs besides time: FLOPs, bytes moved, optimizer state, transient memory.

Each counter runs one step under a dispatch mode, so take counts in a step that is not timed.
Works on CPU and CUDA.

- FLOPs: ``torch.utils.flop_counter.FlopCounterMode``, plus the in-place matmuls it does not count
  (``addmm_``, ``baddbmm_``, ...) and standard operation counts for Cholesky, triangular solves and QR.
- Bytes moved: ``TrafficMode`` adds, for every aten op, the bytes of the tensors it reads and writes.
- Transient memory: on CUDA the allocator's peak; on CPU the running sum of the allocations and
  frees that ``torch.profiler`` records (workspaces inside ops included), or, where the profiler
  cannot report them, ``TrafficMode``'s tracking of the storages ops return until they are freed.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten


def _flop_counter() -> ModuleType:
    """``torch.utils.flop_counter``, imported on first use: it imports triton when installed, and
    importing this module must not (the Triton interpreter tests have to import triton first)."""
    import torch.utils.flop_counter

    return torch.utils.flop_counter

# Ops that overwrite their mutated argument without reading it (the rest read and write it).
_WRITE_ONLY = {"copy_", "_foreach_copy_", "fill_", "_foreach_fill_", "zero_", "_foreach_zero_", "normal_",
               "uniform_", "random_"}
# Gathers read only the selected elements of their source: as many as they write.
_GATHERS = {"index_select", "index", "gather", "take", "masked_select"}
# In-place scatters touch only the selected slices of ``self``: as many elements as the source holds.
# The second set also reads those slices (they accumulate).
_SCATTERS_WRITE = {"index_copy_", "scatter_", "index_fill_", "masked_scatter_"}
_SCATTERS_ACCUMULATE = {"index_add_", "scatter_add_", "scatter_reduce_", "index_reduce_", "index_put_",
                        "_index_put_impl_"}
# Allocation without initialization, or metadata only: no data moves.
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
               "resize_", "set_"}
# Views whose schema does not say so (no alias annotation on the result).
_UNANNOTATED_VIEWS = {"_unsafe_view"}
# Matrix products and factorizations; everything else is counted as elementwise / data movement.
MATMUL_OPS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "_scaled_mm", "addbmm", "addbmm_",
              "linalg_cholesky_ex", "linalg_solve_triangular", "linalg_qr", "geqrf", "orgqr", "triangular_solve",
              "_linalg_svd", "linalg_eigh", "_linalg_eigh"}


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, Tensor)]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _operand_key(t: Tensor) -> tuple:
    """Which elements of which memory a tensor operand is (equal for the same tensor passed twice)."""
    storage = _storage(t)
    return (id(t),) if storage is None else (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _storage(t: Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or None for tensors without real memory (meta, sparse, subclasses)."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _linalg_flops(name: str, args: tuple, kwargs: dict, out: Any) -> int:
    """Textbook operation counts (multiply and add counted as 2) of the factorizations Dion uses.

    FlopCounterMode leaves these out; they are small next to the matmuls (r×r or m×r with r ≪ n).
    """
    if name == "linalg_cholesky_ex":  # n³/3 per matrix
        a = args[0]
        n = a.shape[-1]
        return int(math.prod(a.shape[:-2]) * n**3 / 3)
    if name == "linalg_solve_triangular":  # A [.., n, n], B [.., rows, cols]: n² per right-hand side
        a, b = args[0], args[1]
        n = a.shape[-1]
        rhs = b.shape[-1] if kwargs.get("left", True) else b.shape[-2]
        return int(math.prod(b.shape[:-2]) * n * n * rhs)
    if name == "linalg_qr":  # Householder on m×n (m ≥ n): 2mn² − 2n³/3, and as much again to form Q
        a = args[0]
        m, n = a.shape[-2:]
        k = min(m, n)
        return int(math.prod(a.shape[:-2]) * 2 * (2 * max(m, n) * k * k - 2 * k**3 / 3))
    return 0


def _matmul_flops_missing(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of an op that FlopCounterMode's registry does not cover: in-place matmuls, factorizations."""
    registry = _flop_counter().flop_registry
    packet = func.overloadpacket
    if packet in registry:
        return 0
    name = packet.__name__
    if name.endswith("_") and not name.startswith("_"):
        base = getattr(aten, name[:-1], None)
        if base is not None and base in registry:
            return int(registry[base](*args, **kwargs, out_val=out))
    return _linalg_flops(name, args, kwargs, out)


@dataclass
class OpTraffic:
    """One aten op's share of a step: calls, bytes read + written, matmul FLOPs."""

    calls: int = 0
    bytes: int = 0
    flops: int = 0


class TrafficMode(TorchDispatchMode):
    """Counts bytes read and written by every aten op while active, and (``track_memory``) the bytes
    of storages that ops allocate, live at once.

    The byte count is an upper-bound model of the memory traffic between ops: each op reads every
    tensor input from memory and writes every output to memory, with no credit for data still in
    cache from an earlier op, and no fusion across ops. Inside one op each operand counts once (what
    an ideally fused and tiled kernel moves; a large matmul re-reads tiles, so it can move more).
    Views cost nothing, and so do allocations (``empty``). An in-place op reads and writes its
    mutated argument (``copy_``, ``fill_`` and ``zero_`` only write it; fused optimizers only read
    ``grads``); gathers (``index_select``, ``gather``, ...) read as many elements as they write;
    in-place scatters (``index_copy_``, ``index_add_``, ...) touch only the slices their source covers.

    Memory: an op's output whose storage is not one of its inputs' storages is a new allocation; it
    is live until that storage is freed (a ``weakref.finalize`` on the storage). ``peak_bytes`` is the
    most live at once, counted from when the mode was entered. Allocations inside one op that are
    not its outputs (workspaces) are not seen; on CUDA use the allocator's peak instead.
    """

    def __init__(self, track_memory: bool = True) -> None:
        super().__init__()
        self.track_memory = track_memory
        self.ops: dict[str, OpTraffic] = defaultdict(OpTraffic)
        self.extra_flops = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}

    # --------------------------------------------------------------------- totals
    @property
    def total_bytes(self) -> int:
        return sum(o.bytes for o in self.ops.values())

    def bytes_where(self, keep: Callable[[str], bool]) -> int:
        return sum(o.bytes for name, o in self.ops.items() if keep(name))

    # --------------------------------------------------------------------- the mode
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Before the op: an out= tensor it resizes gets a new storage, which is an allocation.
        inputs = {s.data_ptr() for s in map(_storage, _tensors((args, kwargs))) if s is not None} \
            if self.track_memory else set()
        out = func(*args, **kwargs)
        schema = func._schema
        name = func.overloadpacket.__name__
        if name in _UNANNOTATED_VIEWS or \
                any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no data moves, nothing is allocated
        read, written = self._traffic(name, schema, args, kwargs, out)
        entry = self.ops[name]
        entry.calls += 1
        entry.bytes += read + written
        flops = _matmul_flops_missing(func, args, kwargs, out)
        entry.flops += flops
        self.extra_flops += flops
        if self.track_memory:
            self._track(inputs, out)
        return out

    @staticmethod
    def _traffic(name: str, schema: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
        if name in _NO_TRAFFIC:
            return 0, 0
        read = written = 0
        out_bytes = sum(_nbytes(t) for t in _tensors(out))
        values = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)]
        # What a scatter writes into ``self``: its source, or for a scalar fill the selected slices.
        source_bytes = sum(_nbytes(t) for a, v in zip(schema.arguments, values)
                           if a.name in ("source", "src", "values", "value") for t in _tensors(v))
        if name == "index_fill_" and isinstance(values[0], Tensor) and values[0].ndim > 0:
            target, dim, index = values[0], values[1], values[2]
            source_bytes = _nbytes(target) // max(target.shape[dim], 1) * index.numel()
        seen: set[tuple] = set()  # one operand passed twice (addcmul_(g, g)) is read once
        for i, (arg, value) in enumerate(zip(schema.arguments, values)):
            tensors = _tensors(value)
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            if not mutated:
                tensors = [t for t in tensors if _operand_key(t) not in seen]
            seen.update(_operand_key(t) for t in tensors)
            if not tensors:
                continue
            size = sum(_nbytes(t) for t in tensors)
            if mutated and name.startswith("_fused_") and arg.name == "grads":
                mutated = False  # marked mutable for unscaling (grad_scale), only read by the update itself
            is_out = getattr(arg, "is_out", arg.kwarg_only and mutated)
            if mutated and is_out:
                written += size
            elif mutated and name in _SCATTERS_WRITE:
                written += source_bytes
            elif mutated and name in _SCATTERS_ACCUMULATE:
                read += source_bytes
                written += source_bytes
            elif mutated and name in _WRITE_ONLY:
                written += size
            elif mutated:
                read += size
                written += size
            elif name in _GATHERS and i == 0:
                read += out_bytes  # only the gathered elements of the source are read
            else:
                read += size
        # Fresh outputs (not an alias of a mutated argument, those were counted above).
        if not any(r.alias_info is not None for r in schema.returns):
            written += out_bytes
        return read, written

    def _track(self, inputs: set[int], out: Any) -> None:
        for t in _tensors(out):
            storage = _storage(t)
            if storage is None:
                continue
            ptr, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or ptr in inputs or ptr in self._live:
                continue
            self._live[ptr] = size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            # Holds no reference to the storage: fires when the last tensor on it is gone.
            done = weakref.finalize(storage, self._release, ptr)
            done.atexit = False

    def _release(self, ptr: int) -> None:
        size = self._live.pop(ptr, 0)
        self.live_bytes -= size


# ------------------------------------------------------------------------------ sizes of things
def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(_nbytes(t) for t in tensors)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-element state (momenta, second moments, per-row variances,
    Dion's right factors). 0-dim tensors (step counters, a few bytes each) are not counted."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, Tensor) and v.ndim > 0:
                total += _nbytes(v)
    return total


def megabatch_bytes(params: Sequence[Tensor]) -> dict[tuple, int]:
    """Bytes of each group of same-shape, same-dtype, same-device matrices (how orthoptim batches them)."""
    groups: Counter[tuple] = Counter()
    for p in params:
        groups[(tuple(p.shape), p.dtype, p.device)] += _nbytes(p)
    return dict(groups)


def largest_megabatch_bytes(params: Sequence[Tensor]) -> int:
    groups = megabatch_bytes(params)
    return max(groups.values()) if groups else 0


# ------------------------------------------------------------------------------ one counted step
@dataclass
class StepCounts:
    """What one step cost. ``passes`` = bytes moved / bytes of the matrix parameters."""

    flops: int
    bytes_moved: int
    matmul_bytes: int
    param_bytes: int
    peak_transient_bytes: int
    transient_source: str  # "cuda allocator", "cpu profiler" or "dispatch tracker"
    ops: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def passes(self) -> float:
        return self.bytes_moved / self.param_bytes if self.param_bytes else float("nan")

    @property
    def elementwise_passes(self) -> float:
        """Passes outside matrix products: momentum, stacking, normalization, selection, the update."""
        return (self.bytes_moved - self.matmul_bytes) / self.param_bytes if self.param_bytes else float("nan")

    def top_ops(self, n: int = 5) -> list[tuple[str, float, int]]:
        """(op, passes, calls) of the ``n`` ops that move the most bytes."""
        ranked = sorted(self.ops.items(), key=lambda kv: -kv[1]["bytes"])[:n]
        return [(name, o["bytes"] / self.param_bytes if self.param_bytes else float("nan"), o["calls"])
                for name, o in ranked]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passes"] = self.passes
        d["elementwise_passes"] = self.elementwise_passes
        return d


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: the profiler's C++ side logs its start and stop there. Nothing to do
    where it is closed (or there is no sys.stderr)."""
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class CpuAllocations:
    """The bytes live at once above the start, from the CPU allocations and frees that
    ``torch.profiler`` records while active (``peak_bytes``; None where this torch cannot report them)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._profiler: Any = None

    def __enter__(self) -> CpuAllocations:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profiler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with _quiet_stderr():
            self._profiler.stop()
        try:
            events = self._profiler.profiler.kineto_results.events()
            cpu = torch._C._autograd.DeviceType.CPU
            changes = sorted(((e.start_ns(), e.nbytes()) for e in events
                              if e.name() == "[memory]" and e.device_type() == cpu),
                             key=lambda c: (c[0], -c[1]))  # at equal times allocations first: no understated peak
        except (AttributeError, RuntimeError):
            return
        live = peak = 0
        for _, change in changes:
            live += change
            peak = max(peak, live)
        self.peak_bytes = peak


def count_step(step: Callable[[], Any], params: Sequence[Tensor], device: str | torch.device = "cpu") -> StepCounts:
    """Run ``step`` once under the counters and report its FLOPs, bytes and transient memory.

    ``params`` are the matrix parameters: their bytes are the unit of ``passes``. The transient
    peak is what the step allocates above what was allocated before it, at its most: on CUDA the
    allocator's peak; on CPUs the profiler's allocation events (``CpuAllocations``), or where
    those are missing ``TrafficMode``'s tracker (which does not see workspaces inside ops).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    traffic = TrafficMode(track_memory=not cuda)
    flop_mode = _flop_counter().FlopCounterMode(display=False)
    allocations = CpuAllocations() if not cuda else contextlib.nullcontext()
    with allocations, flop_mode, traffic:
        step()
    source = "cuda allocator"
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline
    elif allocations.peak_bytes is not None:
        peak, source = allocations.peak_bytes, "cpu profiler"
    else:
        peak, source = traffic.peak_bytes, "dispatch tracker"
    ops = {name: asdict(o) for name, o in traffic.ops.items()}
    return StepCounts(
        flops=int(flop_mode.get_total_flops()) + traffic.extra_flops,
        bytes_moved=traffic.total_bytes,
        matmul_bytes=traffic.bytes_where(lambda name: name in MATMUL_OPS),
        param_bytes=tensor_bytes(params),
        peak_transient_bytes=int(peak),
        transient_source=source,
        ops=ops,
    )
