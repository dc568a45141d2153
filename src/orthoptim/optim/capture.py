"""CUDA-graph capture of an optimizer step, and a check that a step never waits on the device.

A step that reads no value back to the host (no ``.item()``, no ``bool(tensor)``, no ``nonzero``)
can be recorded once as a CUDA graph and replayed: one launch instead of hundreds of small kernels.
Build the optimizer with ``capturable=True`` (learning rates and AdamW's step count become device
tensors; non-finite gradients are flagged rather than refused), then::

    step = orthoptim.CapturedStep(opt)
    for batch in data:
        model(batch).backward()          # gradients land in the same .grad tensors every step
        step()                           # eager warm-up steps, then capture, then replays
        opt.zero_grad(set_to_none=False)
        scheduler.step()                 # fills the lr tensors in place: the graph reads them
    opt.check_nonfinite()                # every few steps: one flag read back from the device

On parameters that are not on CUDA the helper just calls ``optimizer.step()``, so the same script
runs on a CPU. ``HostSyncCounter`` finds host reads on any device (tests run it on the CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from orthoptim.distributed.dtensor import local_tensor

# Ops that copy a device value to the host or whose output size depends on tensor values.
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::_unique",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::equal",
    "aten::allclose",
    "aten::bincount",
})
# Ops that sync only with a boolean index (its True count sizes the output), and one that syncs
# unless it is told its output size.
BOOLEAN_INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
# Tensor methods that read values to the host without an op a dispatch mode sees (on a CPU tensor no
# copy runs at all, but the same call on a CUDA tensor waits for the device).
HOST_READ_METHODS = ("tolist", "cpu", "numpy")


def capturing() -> bool:
    """Whether a CUDA graph is being captured now (never on a build or machine without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _reads_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether this op, with these arguments, waits on the device to read a value back."""
    if name in HOST_SYNC_OPS:
        return True
    if name in BOOLEAN_INDEX_OPS:
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or ()) if t is not None)
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None
    if name in ("aten::_to_copy", "aten::copy_"):  # a copy from an accelerator into host memory
        src, dst_device = (args[0], kwargs.get("device")) if name == "aten::_to_copy" else (args[1], args[0].device)
        return (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None and
                torch.device(dst_device).type == "cpu")
    return False


class _HostReadMethods(TorchFunctionMode):
    """The methods of ``HOST_READ_METHODS``, seen at the torch-function level (per thread, nested
    properly, nothing patched), recorded into a ``HostSyncCounter``'s names."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in HOST_READ_METHODS and func is getattr(torch.Tensor, name, None):
            self.counter.names.append(f"Tensor.{name}")
            self.counter.in_method += 1  # the copy it runs is this read, not another one
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.counter.in_method -= 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter(TorchDispatchMode):
    """Records, in ``.names``, every host read inside the ``with`` block: the ops of ``HOST_SYNC_OPS``,
    indexing with a boolean mask, ``repeat_interleave`` without ``output_size``, copies from an
    accelerator to the host, and the methods of ``HOST_READ_METHODS`` (on any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.in_method = 0
        self._methods = _HostReadMethods(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if not self.in_method and _reads_to_host(name, args, kwargs):
            self.names.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        self._methods.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._methods.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._methods.__exit__(*exc)


class CapturedStep:
    """Calls ``optimizer.step()``: ``warmup_steps`` times eagerly on a side stream, then records one
    step as a CUDA graph and replays it on every later call (each call is exactly one step).

    The graph keeps the addresses it was recorded with, so every call checks (on the host, without
    syncing) that each parameter's ``.grad`` is the same tensor and each group's ``lr`` the same
    tensor object as at capture, and raises with the fix if not.
    """

    def __init__(self, optimizer: Any, warmup_steps: int = 3) -> None:
        if not getattr(optimizer, "capturable", False):
            raise ValueError(
                f"{type(optimizer).__name__} was built without capturable=True: its step reads values back "
                "to the host and cannot be captured; construct it with capturable=True"
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an int >= 1 (CUDA libraries initialize "
                             "their workspaces in the first steps, which capture cannot record)")
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.graph: Any = None
        self._calls = 0
        self._layout: tuple | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _current_layout(self) -> tuple:
        # A DTensor's own data_ptr() is 0: the address that matters is its local shard's.
        grads = tuple(None if p.grad is None else (id(p.grad), local_tensor(p.grad).data_ptr(), tuple(p.grad.shape))
                      for p in self._params())
        lrs = tuple(id(g["lr"]) for g in self.optimizer.param_groups)
        return grads, lrs

    def __call__(self) -> None:
        params = self._params()
        if not (torch.cuda.is_available() and params and all(p.is_cuda for p in params)):
            self.optimizer.step()  # capture is a CUDA feature; elsewhere the step runs eagerly
            return
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"CapturedStep: the parameters are on {len(devices)} GPUs ({sorted(map(str, devices))}); a CUDA "
                "graph records one device's stream, so work on the others would run once and never replay. "
                "Build one optimizer (and one CapturedStep) per device"
            )
        # Streams, the graph and every kernel of the step belong to the parameters' device, which
        # need not be the current one.
        with torch.cuda.device(params[0].device):
            self._step()

    def _step(self) -> None:
        layout = self._current_layout()
        if self.graph is not None:
            if layout != self._layout:
                changed = "a group's lr was replaced" if layout[1] != self._layout[1] else "gradients moved"
                raise RuntimeError(
                    f"CapturedStep: {changed} since capture; the graph reads the tensors it was recorded with. "
                    "Zero gradients with optimizer.zero_grad(set_to_none=False), and change a learning rate in "
                    "place (group['lr'].fill_(value), as torch LR schedulers do), never by assignment"
                )
            self.graph.replay()
            return
        if self._calls < self.warmup_steps:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.optimizer.step()
            torch.cuda.current_stream().wait_stream(side)
            self._calls += 1
            return
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.optimizer.step()
        self.graph, self._layout = graph, layout
        graph.replay()  # capture records without running: this call's step happens here
