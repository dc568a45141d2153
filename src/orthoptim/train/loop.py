"""The training loop of `orthoptim train`: one GPT, one optimizer, one run, in the order it happens.

``train(name, cfg, data, out_dir)`` builds the model from ``cfg.seed``, the optimizer ``name`` and
runs ``cfg.steps`` steps on batches fixed by (seed, step); a comparison calls it once per optimizer,
so every optimizer starts from the same weights and sees the same batches.
Each step: set the learning rate from the schedule → batch → forward → backward → clip (AdamW
parameters only, see ``clip_parameters``) → optimizer step → record. Validation every
``eval_every`` steps on the same windows each time; checkpoints every ``save_every`` steps.
Under torchrun, ``Parallel`` says how the model is spread: DDP, FSDP2 or HSDP (``shard_model``).
"""

from __future__ import annotations

import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import orthoptim
from orthoptim.distributed.comm import reduce_scatter_single
from orthoptim.kernels import cpu_dtype
from orthoptim.train.data import Dataset
from orthoptim.train.model import GPT, GPTConfig
from orthoptim.train.results import save_torch

try:
    import resource  # POSIX only
except ImportError:
    resource = None  # type: ignore[assignment]

OPTIMIZERS = ("dion3", "muon", "adamw", "dion", "dion2", "normuon")

# Peak learning rates, each chosen by a sweep of the default configuration at the default number of
# steps (docs/cli.md has the sweep table and how to rerun it). For the orthonormal optimizers this is
# the lr of the matrices (spectral_norm scaling); their AdamW groups (embeddings, head, norms) use the
# AdamW learning rate, so that only the matrix rule differs between runs.
DEFAULT_LR = {
    "dion3": 0.02,
    "muon": 0.02,
    "adamw": 0.004,
    "dion": 0.01,
    "dion2": 0.01,
    "normuon": 0.02,
}


@dataclass
class TrainConfig:
    """Everything that decides a run. Defaults: the 2-CPU-core comparison (a few minutes per optimizer)."""

    optimizers: list[str] = field(default_factory=lambda: ["dion3"])
    # data
    data: str | None = None  # None: the built-in corpus (Python standard library source, bytes)
    cache_dir: str | None = None  # where the built-in corpus is cached (default ~/.cache/orthoptim)
    corpus_mb: float = 4.0  # size of the built-in corpus sample (MiB of source text)
    vocab_size: int | None = None  # None: 256 for text, from the tokens for .bin shards
    # model
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    context: int = 128
    mlp_ratio: int = 4
    positions: str = "rope"
    # optimization
    steps: int = 600
    batch_size: int = 16
    lr: dict[str, float] = field(default_factory=dict)  # per optimizer; missing ones use DEFAULT_LR
    scalar_lr: float | None = None  # lr of the AdamW groups of orthonormal optimizers; None: AdamW's lr
    weight_decay: float = 0.01  # on the matrices only (never on embeddings, head, norms)
    fraction: float = 0.25  # dion3, dion2: share of rows orthogonalized per step
    rank_fraction: float = 0.25  # dion: rank / min(m, n)
    warmup: float = 0.05  # share of steps with linear warm-up from 0
    cooldown: float = 0.4  # share of steps, at the end, with linear decay to 0
    clip: float = 1.0  # max global gradient norm of the AdamW-updated parameters; 0 disables
    # dion3, dion2 under --fsdp/--hsdp: "global" picks the rows one process would (the result does not
    # depend on the layout); "local" picks per shard and sends fewer bytes. No effect otherwise.
    selection_scope: str = "global"
    # evaluation, checkpoints, hardware
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 100  # checkpoint every this many steps (and at the end); 0: only at the end
    seed: int = 0
    device: str = "cpu"
    autocast: str = "auto"  # "auto": bfloat16 on CUDA, off on CPU; "bf16"; "off"

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size or vocab_size, context=self.context, n_layer=self.n_layer,
                         n_head=self.n_head, d_model=self.d_model, mlp_ratio=self.mlp_ratio,
                         positions=self.positions)

    def lr_for(self, name: str) -> float:
        return self.lr.get(name, DEFAULT_LR[name])

    def scalar_lr_value(self) -> float:
        return self.scalar_lr if self.scalar_lr is not None else self.lr_for("adamw")

    def resolved(self) -> TrainConfig:
        """A copy with every learning rate written out, so that neither config.json nor the reproduce
        command depends on DEFAULT_LR (which a later version may change)."""
        scalar = self.scalar_lr_value() if any(n != "adamw" for n in self.optimizers) else self.scalar_lr
        return replace(self, lr={n: self.lr_for(n) for n in self.optimizers}, scalar_lr=scalar)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Warm-up, constant, then linear decay to 0: the multiplier of every group's peak lr at ``step``."""
    warmup_steps = round(cfg.warmup * cfg.steps)
    cooldown_steps = round(cfg.cooldown * cfg.steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= cfg.steps - cooldown_steps:
        return (cfg.steps - step) / max(cooldown_steps, 1)
    return 1.0


# ------------------------------------------------------------------------------------ layout
@dataclass
class Parallel:
    """How a torchrun run spreads the model over its processes (ignored on one process).

    ``mode``: "ddp" (whole model on every rank, DDP averages gradients), "fsdp" (FSDP2, rows of every
    parameter sharded over all ranks) or "hsdp" (FSDP2 on a ("replicate", "shard") mesh: sharded
    within a row of the mesh, replicated across rows). ``mesh``: the device mesh of fsdp/hsdp.
    """

    mode: str = "ddp"
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh for fsdp/hsdp

    @property
    def sharded(self) -> bool:
        return self.mode in ("fsdp", "hsdp")

    @property
    def shard_mesh(self) -> Any:
        """The 1-D mesh the parameters' rows are sharded over: what the optimizer exchanges rows on."""
        return self.mesh["shard"] if self.mode == "hsdp" else self.mesh


def make_parallel(mode: str, device: torch.device, hsdp: tuple[int, int] | None = None) -> Parallel:
    """The layout of a torchrun run; call after ``init_process_group`` (the mesh makes sub-groups)."""
    if mode == "ddp":
        return Parallel("ddp")
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "fsdp":
        return Parallel("fsdp", init_device_mesh(device.type, (dist.get_world_size(),)))
    if mode == "hsdp" and hsdp is not None:
        return Parallel("hsdp", init_device_mesh(device.type, hsdp, mesh_dim_names=("replicate", "shard")))
    raise ValueError(f"unknown parallel mode {mode!r} (hsdp needs its (replicate, shard) shape)")


def shard_model(model: GPT, parallel: Parallel) -> None:
    """FSDP2 in place: each block is one unit (gathered just before it runs, freed after), then the
    root takes what is left (embeddings, final norm, head). Wrapping the root last keeps a weight
    shared by two of those modules one parameter (tied embeddings stay tied). On a 2-D mesh
    ``fully_shard`` replicates over the first dimension and shards over the second (HSDP)."""
    from torch.distributed.fsdp import fully_shard

    options = fully_shard_options(parallel.mesh)
    for block in model.blocks:
        fully_shard(block, mesh=parallel.mesh, **options)
    fully_shard(model, mesh=parallel.mesh, **options)


# FSDP2 can average HSDP replicas over gloo (CPU) from this torch on: before it, its replica
# all-reduce asks gloo for ReduceOp.AVG and then waits for a CUDA event.
CPU_HSDP_MIN_TORCH = "2.8"


def fully_shard_options(mesh: Any) -> dict[str, Any]:
    """Extra ``fully_shard`` arguments for a model sharded over the DeviceMesh ``mesh``: none, except on
    CPU meshes where gloo's reduce-scatter sums when asked for ReduceOp.AVG (torch 2.7 and 2.8), which
    leaves FSDP2's fp32/bf16 gradients world-size times too large (silently: orthonormal updates and
    AdamW ignore the gradient's scale, but the clip threshold, grad norms and saved momenta do not).
    There ``fp64_reduce_options``. One tiny reduce-scatter of CPU tensors over the mesh's shard group
    (its last dimension, where FSDP2 reduce-scatters) finds out, whatever the backend string says:
    call it on every rank of the mesh, once, and pass the result to every ``fully_shard`` call."""
    if mesh.device_type != "cpu":
        return {}
    group = mesh.get_group(mesh.ndim - 1)
    averaged = torch.empty(1)
    reduce_scatter_single(averaged, torch.ones(dist.get_world_size(group)), op=dist.ReduceOp.AVG, group=group)
    return {} if averaged.item() == 1.0 else fp64_reduce_options()


def fp64_reduce_options() -> dict[str, Any]:
    """``fully_shard`` with an fp64 reduce dtype: FSDP2 then reduce-scatters with SUM and divides by the
    world size itself, and the gradients keep their dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float64)}


# ------------------------------------------------------------------------------------ optimizer
def build_optimizer(name: str, model: nn.Module, cfg: TrainConfig,
                    distributed_mesh: Any = None) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``orthoptim.param_groups(model)``: matrices get the named rule;
    embeddings, the head, norms get AdamW (no weight decay). The AdamW baseline is
    torch.optim.AdamW over the very same groups (weight decay on the matrices only).

    ``distributed_mesh``: under DDP the process group, so each rank orthogonalizes a share of the
    matrices; under FSDP/HSDP the 1-D mesh the rows are sharded over (for Dion the same argument is
    its ``outer_shard_mesh``).
    """
    lr = cfg.lr_for(name)
    groups = orthoptim.param_groups(model, scalar_lr=cfg.scalar_lr_value(), scalar_weight_decay=0.0)
    if name == "adamw":
        plain = [{"params": g["params"], "weight_decay": g.get("weight_decay", cfg.weight_decay)} for g in groups]
        return torch.optim.AdamW(plain, lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, foreach=True)
    options: dict[str, Any] = {"lr": lr, "weight_decay": cfg.weight_decay}
    if name in ("dion3", "dion2"):
        options["fraction"] = cfg.fraction
        options["selection_scope"] = cfg.selection_scope
    if name == "dion":
        options["rank_fraction"] = cfg.rank_fraction
    classes = {"dion3": orthoptim.Dion3, "dion2": orthoptim.Dion2, "dion": orthoptim.Dion,
               "muon": orthoptim.Muon, "normuon": orthoptim.NorMuon}
    if distributed_mesh is not None:
        options["distributed_mesh"] = distributed_mesh  # Dion too: its outer_shard_mesh, or DDP's group
    return classes[name](groups, **options)


def clip_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose gradients are clipped: those an Adam-type rule updates.

    An orthonormal rule's step has a fixed size (lr·scale·orth(M)): scaling a gradient down changes
    nothing about the step's norm, only how much that step weighs in the momentum against earlier
    ones. So clipping cannot tame an orthonormal step; it can only reweight history. Adam's step
    instead follows the gradient's size through its moment estimates, which is what clipping guards.
    """
    if not isinstance(optimizer, orthoptim.OrthonormalOptimizer):
        return [p for g in optimizer.param_groups for p in g["params"]]
    return [p for g in optimizer.param_groups if g["algorithm"] in ("adamw", "lion") for p in g["params"]]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


# ------------------------------------------------------------------------------------ helpers
def world() -> tuple[int, int]:
    """(rank, world size): (0, 1) unless started by torchrun with more than one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run_device(cfg: TrainConfig) -> torch.device:
    """cfg.device; under torchrun, ``cuda`` means this process's GPU (LOCAL_RANK)."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None and world()[1] > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def effective_autocast(autocast: str, device: str | torch.device) -> str:
    """"bf16" or "off": what ``--autocast`` means on ``device`` ("auto": bf16 on CUDA only)."""
    if autocast == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "off"
    return autocast


def _autocast(cfg: TrainConfig, device: torch.device):
    use = effective_autocast(cfg.autocast, device) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16) if use else nullcontext()


@torch.no_grad()
def evaluate(model: GPT, data: Dataset, cfg: TrainConfig, device: torch.device) -> float:
    """Mean validation loss (nats/token) over the same ``eval_batches`` windows every time."""
    model.eval()
    losses = []
    for i in range(cfg.eval_batches):
        x, y = data.batch("val", cfg.batch_size, cfg.context, cfg.seed, i, device)
        with _autocast(cfg, device):
            _, loss = model(x, y)
        losses.append(loss.item())
    model.train()
    return sum(losses) / len(losses)


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """CUDA: peak allocated by this run. CPU: the process's peak resident set (all runs so far)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated (this run)"
    if resource is None:
        return float("nan"), "not measured on this platform"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10), "process peak RSS (cumulative)"


def checkpoint_path(out_dir: Path, name: str) -> Path:
    return out_dir / "checkpoints" / f"{name}.pt"


def _names_in_optimizer_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each optimizer parameter's name, in the order ``optimizer.state_dict()`` numbers them; the
    names are those ``torch.distributed.checkpoint.state_dict`` keys the optimizer state by."""
    name_of = {p: n for n, p in model.named_parameters()}  # a tied weight: its first name, as torch
    return [name_of[p] for g in optimizer.param_groups for p in g["params"]]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel | None) -> tuple[dict, dict]:
    """Model and optimizer state dicts with whole tensors, in the one-process format (optimizer state
    keyed by position), so a checkpoint resumes under any layout and world size.

    Under FSDP/HSDP every rank must call this (it gathers the shards); rank 0 gets the tensors, on
    the CPU, and the other ranks empty dicts.
    """
    if parallel is None or not parallel.sharded:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    if not by_name:
        return model_sd, {}
    position = {n: i for i, n in enumerate(_names_in_optimizer_order(model, optimizer))}
    optim_sd = {"state": {position[n]: v for n, v in by_name["state"].items()},
                "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in by_name["param_groups"]]}
    return model_sd, optim_sd


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict,
                    parallel: Parallel | None) -> None:
    """The inverse of ``full_state``: under FSDP/HSDP each rank keeps its shard of the whole tensors."""
    if parallel is None or not parallel.sharded:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, ckpt["model"], options=options)
    names = _names_in_optimizer_order(model, optimizer)
    saved = ckpt["optimizer"]
    by_name = {"state": {names[i]: v for i, v in saved["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


def _new_history() -> dict[str, list]:
    return {"step": [], "train_loss": [], "time_s": [], "step_ms": [], "opt_ms": [], "grad_norm": [],
            "lr": [], "val_step": [], "val_loss": [], "val_time_s": []}


# ------------------------------------------------------------------------------------ one run
def train(name: str, cfg: TrainConfig, data: Dataset, out_dir: Path, *, stop_at: int | None = None,
          progress: Callable[[str, int, dict], None] | None = None, parallel: Parallel | None = None) -> dict:
    """Train one GPT with optimizer ``name``; resume from ``out_dir``'s checkpoint when there is one.

    Returns the run's record (summary numbers and the full history). With ``stop_at``, stops after
    that step (checkpoint written) and returns the record with ``finished`` False. ``parallel``:
    the layout under torchrun (default DDP).
    """
    device = run_device(cfg)
    rank, world_size = world()
    if world_size == 1:
        parallel = None
    elif parallel is None:
        parallel = Parallel("ddp")
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config(data.vocab_size)).to(device)
    if parallel is not None and parallel.sharded:
        # Every rank builds the same whole model from the seed and keeps its shard: the same weights
        # as one process.
        shard_model(model, parallel)
        mesh = parallel.shard_mesh
    else:
        mesh = dist.group.WORLD if parallel is not None else None
    optimizer = build_optimizer(name, model, cfg, mesh)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]  # the peak lr; the schedule scales it each step
    clipped = clip_parameters(optimizer)
    tokens_per_step = cfg.batch_size * cfg.context
    step, history, earlier_peak_mb = 0, _new_history(), 0.0

    ckpt_file = checkpoint_path(out_dir, name)
    if ckpt_file.exists():
        # Sharded: each rank reads the whole file to the CPU and keeps its shard.
        where = "cpu" if parallel is not None and parallel.sharded else device
        try:
            ckpt = torch.load(ckpt_file, map_location=where, weights_only=False)
        except Exception as e:  # a truncated or foreign file fails in many ways (OSError, pickle, zip)
            raise CheckpointError(f"{ckpt_file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}); "
                                  "remove it to retrain that optimizer from the start") from None
        if not isinstance(ckpt, dict) or not {"model", "optimizer", "step", "history"} <= set(ckpt):
            raise CheckpointError(f"{ckpt_file} is not a checkpoint of orthoptim train (no model, optimizer, step "
                                  "and history in it); remove it to retrain that optimizer from the start")
        check_same_config(ckpt_file, ckpt.get("config"), cfg)
        check_same_run(ckpt_file, ckpt, name, device)
        load_full_state(model, optimizer, ckpt, parallel)
        step, history, earlier_peak_mb = ckpt["step"], ckpt["history"], ckpt.get("peak_memory_mb", 0.0)

    # Under torchrun: DDP, or FSDP2 (model already sharded), averages the gradients of the ranks'
    # shares of each batch in backward().
    net = model if parallel is None or parallel.sharded else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)

    def save() -> None:
        model_sd, optim_sd = full_state(model, optimizer, parallel)  # every rank: FSDP gathers here
        if rank == 0:
            save_torch(ckpt_file, {"model": model_sd, "optimizer": optim_sd, "step": step,
                                   "history": history, "config": asdict(cfg), "optimizer_name": name,
                                   "cpu_iteration_dtype": _cpu_iteration_dtype(device),
                                   "peak_memory_mb": max(earlier_peak_mb, peak_memory_mb(device)[0])})
        if world_size > 1:
            dist.barrier()  # the other ranks wait until rank 0 has written it

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    resumed_at = step
    while True:
        # validation: at step 0, every eval_every steps, and at the end
        if (step % cfg.eval_every == 0 or step == cfg.steps) and (not history["val_step"]
                                                                   or history["val_step"][-1] != step):
            history["val_step"].append(step)
            history["val_loss"].append(evaluate(model, data, cfg, device))
            history["val_time_s"].append(history["time_s"][-1] if history["time_s"] else 0.0)
        if step == cfg.steps or (stop_at is not None and step >= stop_at):
            break

        factor = lr_factor(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

        t0 = time.perf_counter()
        x, y = data.batch("train", cfg.batch_size, cfg.context, cfg.seed, step, device, rank, world_size)
        with _autocast(cfg, device):
            _, loss = net(x, y)
        loss.backward()
        # The logged norm is the whole model's gradient, before clipping, so that it compares across
        # optimizers (clipping sees only the Adam-type parameters). Under FSDP the gradients are
        # DTensor shards; both norms are reduced over the mesh, as on one process.
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(clipped, cfg.clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        _sync(device)
        t1 = time.perf_counter()
        optimizer.step()
        _sync(device)
        t2 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)

        if world_size > 1:  # log the loss of the whole batch, not of this rank's share
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # sum (gloo has no average)
            loss /= world_size
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"training loss became {loss_value} at step {step}; "
                                     f"lower the learning rate (--lr, now {cfg.lr_for(name)})")
        step += 1
        history["step"].append(step)
        history["train_loss"].append(loss_value)
        history["time_s"].append((history["time_s"][-1] if history["time_s"] else 0.0) + (t2 - t0))
        history["step_ms"].append((t2 - t0) * 1e3)
        history["opt_ms"].append((t2 - t1) * 1e3)
        history["grad_norm"].append(float(grad_norm))
        history["lr"].append(cfg.lr_for(name) * factor)
        if progress is not None:
            progress(name, step, {"loss": loss_value, "val": history["val_loss"][-1],
                                  "tok_s": tokens_per_step * step / history["time_s"][-1]})
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            save()
    if step > resumed_at or not ckpt_file.exists():
        save()

    # Medians skip the first steps of each process that trained (allocation, warm-up of kernels: a
    # resumed run's first step is as cold as the first one); sums would let one stall dominate.
    step_ms = _warm_median(history["step_ms"], resumed_at, step)
    opt_ms = _warm_median(history["opt_ms"], resumed_at, step)
    peak_mb, peak_kind = peak_memory_mb(device)
    peak_mb = earlier_peak_mb if 0 < resumed_at == step else max(peak_mb, earlier_peak_mb)
    final = history["val_loss"][-1]
    return {
        "optimizer": name,
        "finished": step == cfg.steps,
        "steps": step,
        "lr": cfg.lr_for(name),
        "scalar_lr": None if name == "adamw" else cfg.scalar_lr_value(),
        "final_val_loss": final,
        "final_val_bpb": final / math.log(2) / data.bytes_per_token if data.bytes_per_token else None,
        "final_train_loss_ema": _last_ema(history["train_loss"]),
        "tokens_per_s": tokens_per_step * step / history["time_s"][-1] if history["time_s"] else None,
        "step_ms_median": step_ms,
        "opt_ms_median": opt_ms,
        "opt_share": opt_ms / step_ms if step_ms else None,
        "train_time_s": history["time_s"][-1] if history["time_s"] else 0.0,
        "optimizer_state_mb": optimizer_state_bytes(optimizer) / 2**20,
        "peak_memory_mb": peak_mb,
        "peak_memory_kind": peak_kind,
        "parameters": model.num_params(),
        "history": history,
    }


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that was written under another configuration."""


# What may differ between a checkpoint's configuration and the resumed one: where it runs, not what.
_RESUME_MAY_CHANGE = ("device", "cache_dir")


def check_same_config(ckpt_file: Path, saved: dict | None, cfg: TrainConfig) -> None:
    """A resumed run continues the configuration its checkpoint was trained under, or refuses: an
    edited config.json (another lr, more steps) would otherwise mix two runs under one record."""
    if saved is None:
        return  # written by an older version, which saved no configuration
    now = asdict(cfg)
    if "autocast" in saved and "device" in saved:  # "auto" is bf16 on CUDA only: compare what each one ran
        saved = {**saved, "autocast": effective_autocast(saved["autocast"], saved["device"])}
        now = {**now, "autocast": effective_autocast(now["autocast"], now["device"])}
    # Keys only one side has: options of another version of this command, not an edit.
    changed = sorted(k for k in set(saved) & set(now)
                     if k not in _RESUME_MAY_CHANGE and _as_json(saved[k]) != _as_json(now[k]))
    if changed:
        what = ", ".join(f"{k} {saved[k]!r} → {now[k]!r}" for k in changed)
        raise CheckpointError(f"{ckpt_file} was trained with another configuration ({what}); resume with the "
                              "config.json it was written with, or start a new run")


def check_same_run(ckpt_file: Path, ckpt: dict, name: str, device: torch.device) -> None:
    """The checkpoint is this optimizer's (a file copied over another's loaded with a warning and was
    reported under the wrong name), and on CPUs it continues in the iterations' dtype it ran in (a
    run moved between CPUs with and without bf16 matrix units changed its numbers silently)."""
    saved = ckpt.get("optimizer_name")
    if saved is not None and saved != name:
        raise CheckpointError(f"{ckpt_file} holds a checkpoint of {saved!r}, not of {name!r}; put back the "
                              f"file {name} wrote, or remove it to retrain {name} from the start")
    saved, now = ckpt.get("cpu_iteration_dtype"), _cpu_iteration_dtype(device)
    if saved is not None and now is not None and saved != now:
        raise CheckpointError(f"{ckpt_file} ran its polar iterations in {saved} on the CPU and would continue "
                              f"in {now} here; resume with ORTHOPTIM_CPU_DTYPE={saved} to continue as it ran")


def _cpu_iteration_dtype(device: torch.device) -> str | None:
    """The polar iterations' dtype where they run on the CPU (None elsewhere)."""
    return cpu_dtype.iteration_dtype_name() if device.type == "cpu" else None


def _as_json(value: Any) -> Any:
    """Tuples and lists compare equal, as they do once written to config.json."""
    return [_as_json(v) for v in value] if isinstance(value, (list, tuple)) else \
        {k: _as_json(v) for k, v in value.items()} if isinstance(value, dict) else value


def _warm_median(values: list[float], resumed_at: int, step: int) -> float:
    """The median of per-step times without the first steps of each process: up to 5 (at most half)
    from the start, and the first step after a resume."""
    if not values:
        return float("nan")
    skip = set(range(min(5, len(values) // 2)))
    if 0 < resumed_at < step:
        skip.add(resumed_at)  # values[i] is step i + 1's time: the first step this process took
    kept = [v for i, v in enumerate(values) if i not in skip]
    return statistics.median(kept or values)


def _last_ema(values: list[float], beta: float = 0.9) -> float | None:
    if not values:
        return None
    avg = 0.0
    for v in values:
        avg = beta * avg + (1 - beta) * v
    return avg / (1 - beta ** len(values))


def environment(device: str) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "orthoptim": orthoptim.__version__,
           "platform": platform.platform(), "cpu_threads": torch.get_num_threads(), "device": device,
           # The polar iterations' dtype on CPUs depends on the machine (and ORTHOPTIM_CPU_DTYPE).
           "orthoptim_cpu_dtype": cpu_dtype.describe()}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def reproduce_command(cfg: TrainConfig, out: str) -> str:
    """The command line that reruns this configuration with every option spelled out."""
    parts = ["orthoptim", "train"]
    if len(cfg.optimizers) == 1:
        parts += ["--optimizer", cfg.optimizers[0]]
    else:
        parts += ["--compare", ",".join(cfg.optimizers)]
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "optimizers":
            continue
        if f.name == "lr":
            value = ",".join(f"{n}={cfg.lr_for(n)!r}" for n in cfg.optimizers)  # repr: every digit
        if value is None:
            continue
        parts += [f"--{f.name.replace('_', '-')}", str(value)]
    parts += ["--out", out]
    return shlex.join(parts)
