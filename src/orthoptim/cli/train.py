"""`orthoptim train`: train a small GPT with one optimizer or compare several on the same batches."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orthoptim.cli import (
    CommandError,
    HelpFormatter,
    UsageError,
    check_out_dir,
    non_negative_int,
    positive_int,
    seed_int,
)
from orthoptim.train import data as datamod
from orthoptim.train.loop import (
    CPU_HSDP_MIN_TORCH,
    DEFAULT_LR,
    OPTIMIZERS,
    CheckpointError,
    Parallel,
    TrainConfig,
    checkpoint_path,
    effective_autocast,
    environment,
    make_parallel,
    reproduce_command,
    train,
)
from orthoptim.train.progress import Progress
from orthoptim.train.results import format_table, plot_losses, plots_available, write_json, write_text

DESCRIPTION = """\
Train a small GPT language model with one optimizer (--optimizer) or several (--compare), each from
the same initial weights on the same batches, and write results.json, loss.png, summary.txt and
config.json to --out.

Data: by default a byte-level corpus built from this Python's standard library source (no download;
built once, then cached). --data takes a text file, a folder of text files, or GPT speed-run style
.bin token shards (256 int32 header words, magic 20240520, then uint16 tokens).

Learning rates: each optimizer has a default peak lr chosen by a sweep of the default configuration
(docs/cli.md); the orthonormal optimizers update the embeddings, head and norms with AdamW at AdamW's
lr. Schedule: linear warm-up, constant, linear decay to 0 (--warmup, --cooldown). Gradients of the
AdamW-updated parameters are clipped (--clip); an orthonormal step has a fixed size whatever the
gradient's norm, so its matrices are not clipped.
"""

EPILOG = """\
examples:
  orthoptim train --compare dion3,muon,adamw          # the default comparison, a few minutes on 2 CPU cores
  orthoptim train --optimizer muon --lr muon=0.03 --steps 1000
  orthoptim train --compare dion3,muon --fraction 0.5  # Dion3 orthogonalizing half of the rows
  orthoptim train --preset gpu --compare dion3,muon,adamw --device cuda
  orthoptim train --preset gpt2-124m --data fineweb10B/ --device cuda --compare dion3,adamw
  orthoptim train --resume runs/train-20250101-120000  # continue an interrupted run
  torchrun --standalone --nproc_per_node 8 -m orthoptim.cli train --preset gpu --compare dion3,muon
      # data parallel (DDP, or --ddp): each process takes its share of every --batch-size batch
  torchrun --standalone --nproc_per_node 8 -m orthoptim.cli train --preset gpu --fsdp
      # FSDP2: parameters, gradients and optimizer state sharded over the 8 processes
  torchrun --standalone --nproc_per_node 8 -m orthoptim.cli train --preset gpu --hsdp 2,4
      # HSDP: 2 replicas of the model, each sharded over 4 processes
"""

# Presets change the defaults below; options given on the command line still win.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},  # the TrainConfig defaults: ~1 M parameters, minutes on 2 CPU cores
    "gpu": {"d_model": 384, "n_layer": 6, "n_head": 6, "context": 256, "batch_size": 64, "steps": 1500,
            "eval_every": 100, "eval_batches": 20, "save_every": 500, "corpus_mb": 64.0, "device": "cuda"},
    "gpt2-124m": {"d_model": 768, "n_layer": 12, "n_head": 12, "context": 1024, "batch_size": 16, "steps": 5000,
                  "eval_every": 250, "eval_batches": 20, "save_every": 1000, "corpus_mb": 64.0,
                  "positions": "learned", "device": "cuda"},
}

# Options that --resume accepts besides itself: they change how the run is carried out, not its result.
RESUME_OPTIONS = {"device", "cache_dir", "stop_at", "quiet", "no_plot", "threads", "parallel", "hsdp"}


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def _positive_lr(text: str) -> float:
    value = _finite_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("the learning rate must be > 0")
    return value


def _lr_spec(text: str) -> dict[str, float] | float:
    """``0.02`` (every optimizer) or ``muon=0.03,adamw=0.002``."""
    if "=" not in text:
        return _positive_lr(text)
    out: dict[str, float] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in OPTIMIZERS:
            raise argparse.ArgumentTypeError(f"unknown optimizer {name!r} in {text!r}; known: {', '.join(OPTIMIZERS)}")
        out[name] = _finite_float(value)
        if out[name] == 0:
            raise argparse.ArgumentTypeError(f"the learning rate of {name} must be > 0")
    return out


def _mesh_shape(text: str) -> tuple[int, int]:
    """``R,S`` of --hsdp: R replicas, each sharded over S processes."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give R,S (replicas, processes per replica), e.g. 2,4")
    replicas, shards = (positive_int(part.strip()) for part in parts)
    return replicas, shards


def _optimizer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown optimizer(s) {', '.join(unknown)}; known: {', '.join(OPTIMIZERS)}")
    if not names:
        raise argparse.ArgumentTypeError("name at least one optimizer")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names an optimizer twice")
    return names


def _one_optimizer(text: str) -> list[str]:
    if "," in text:
        raise argparse.ArgumentTypeError(f"{text!r}: one name; use --compare for several")
    return _optimizer_list(text)


def add_parser(commands: argparse._SubParsersAction) -> None:
    d = TrainConfig()
    p = commands.add_parser("train", help="train a small GPT with one or several optimizers",
                            description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter,
                            argument_default=argparse.SUPPRESS)
    p.set_defaults(run=run)
    what = p.add_argument_group("what to run")
    which = what.add_mutually_exclusive_group()
    which.add_argument("--optimizer", type=_one_optimizer, dest="optimizers", metavar="NAME",
                       help=f"train with this optimizer: {', '.join(OPTIMIZERS)} (default: dion3)")
    which.add_argument("--compare", type=_optimizer_list, dest="optimizers", metavar="A,B,...",
                       help="train with each of these optimizers in turn, same seed and batches, e.g. dion3,muon,adamw")
    what.add_argument("--preset", choices=sorted(PRESETS),
                      help="a starting configuration: 'cpu' (the defaults shown here), 'gpu' (10.8 M parameters, "
                           "context 256), 'gpt2-124m' (GPT-2 small shapes; use with --data); other options override it")
    what.add_argument("--out", metavar="DIR",
                      help="output folder (default: runs/train-YYYYmmdd-HHMMSS in the current folder)")
    what.add_argument("--resume", metavar="DIR",
                      help="continue the run in DIR (its config.json and checkpoints): finished optimizers are kept, "
                           "the others continue from their last checkpoint with the same schedule and batches")
    what.add_argument("--stop-at", type=positive_int, metavar="STEP",
                      help="stop every optimizer after this step (checkpoint written), e.g. to split a long run "
                           "into jobs; continue with --resume")
    what.add_argument("--quiet", action="store_true", help="no progress line (the summary is still printed)")
    what.add_argument("--no-plot", action="store_true", help="do not write loss.png")

    data = p.add_argument_group("data")
    data.add_argument("--data", metavar="PATH",
                      help="a text file, a folder of text files, or a .bin shard / folder of .bin shards (names "
                           "containing 'val' are the validation split) (default: the built-in corpus)")
    data.add_argument("--cache-dir", metavar="DIR",
                      help="where the built-in corpus is cached (default: $XDG_CACHE_HOME/orthoptim or "
                           "~/.cache/orthoptim)")
    data.add_argument("--corpus-mb", type=_finite_float, metavar="MB",
                      help=f"size of the built-in corpus: MiB of standard-library source (default: {d.corpus_mb:g})")
    data.add_argument("--vocab-size", type=positive_int, metavar="N",
                      help="vocabulary size (default: 256 for text, largest token id + 1 rounded up to 64 for shards)")

    model = p.add_argument_group("model (a pre-norm GPT without biases)")
    model.add_argument("--n-layer", "--layers", type=positive_int, dest="n_layer", metavar="N",
                       help=f"transformer blocks (default: {d.n_layer})")
    model.add_argument("--n-head", "--heads", type=positive_int, dest="n_head", metavar="N",
                       help=f"attention heads (default: {d.n_head})")
    model.add_argument("--d-model", type=positive_int, metavar="N", help=f"width (default: {d.d_model})")
    model.add_argument("--context", type=positive_int, metavar="T",
                       help=f"tokens per training sequence (default: {d.context})")
    model.add_argument("--mlp-ratio", type=positive_int, metavar="R",
                       help=f"MLP hidden width / d_model (default: {d.mlp_ratio})")
    model.add_argument("--positions", choices=("rope", "learned"),
                       help=f"rotary position embedding or a learned position table (default: {d.positions})")

    opt = p.add_argument_group("optimization")
    opt.add_argument("--steps", type=positive_int, metavar="N", help=f"training steps (default: {d.steps})")
    opt.add_argument("--batch-size", type=positive_int, metavar="B",
                     help=f"sequences per step (default: {d.batch_size})")
    opt.add_argument("--lr", type=_lr_spec, metavar="LR",
                     help="peak learning rate: one number for every optimizer or NAME=LR,... per optimizer "
                          f"(default: {', '.join(f'{k}={v:g}' for k, v in DEFAULT_LR.items())})")
    opt.add_argument("--scalar-lr", type=_positive_lr, metavar="LR",
                     help="lr of the AdamW groups (embeddings, head, norms) of the orthonormal optimizers "
                          f"(default: adamw's lr from --lr adamw=LR, else {DEFAULT_LR['adamw']:g})")
    opt.add_argument("--weight-decay", type=_finite_float, metavar="WD",
                     help=f"decoupled weight decay of the matrices; none on embeddings, head, norms "
                          f"(default: {d.weight_decay:g})")
    opt.add_argument("--fraction", type=_finite_float, metavar="F",
                     help=f"dion3, dion2: share of rows orthogonalized each step, in (0, 1] (default: {d.fraction:g})")
    opt.add_argument("--rank-fraction", type=_finite_float, metavar="F",
                     help=f"dion: rank as a share of min(rows, cols), in (0, 1] (default: {d.rank_fraction:g})")
    opt.add_argument("--warmup", type=_finite_float, metavar="SHARE",
                     help=f"share of steps with linear lr warm-up (default: {d.warmup:g})")
    opt.add_argument("--cooldown", type=_finite_float, metavar="SHARE",
                     help=f"share of steps, at the end, with linear lr decay to 0 (default: {d.cooldown:g})")
    opt.add_argument("--clip", type=_finite_float, metavar="NORM",
                     help=f"max global gradient norm of the AdamW-updated parameters, 0 = off (default: {d.clip:g})")
    opt.add_argument("--selection-scope", choices=("global", "local"),
                     help="dion3, dion2 under --fsdp/--hsdp: 'global' picks the rows one process would, so the "
                          "result does not depend on the layout; 'local' picks the top rows of each shard and "
                          f"sends fewer bytes; no effect on one process or DDP (default: {d.selection_scope})")
    opt.add_argument("--seed", type=seed_int, metavar="S", help=f"seed of the weights and batches (default: {d.seed})")

    run_group = p.add_argument_group("evaluation, checkpoints, hardware")
    run_group.add_argument("--eval-every", type=positive_int, metavar="N",
                           help=f"validate every N steps (default: {d.eval_every})")
    run_group.add_argument("--eval-batches", type=positive_int, metavar="N",
                           help=f"batches per validation, the same windows every time (default: {d.eval_batches})")
    run_group.add_argument("--save-every", type=non_negative_int, metavar="N",
                           help=f"checkpoint every N steps, 0 = only at the end (default: {d.save_every})")
    run_group.add_argument("--device", metavar="DEV", help=f"cpu, cuda or cuda:N (default: {d.device})")
    run_group.add_argument("--threads", type=positive_int, metavar="N",
                           help="CPU threads for torch (default: torch's choice, one per core); on a busy machine "
                                "--threads 1 avoids threads waiting on each other")
    run_group.add_argument("--autocast", choices=("auto", "bf16", "off"),
                           help=f"bfloat16 autocast of the model; auto = on for CUDA only (default: {d.autocast})")

    procs = p.add_argument_group(
        "several processes (launch with: torchrun --standalone --nproc_per_node N -m orthoptim.cli train ...)",
        "Each process takes its share of every --batch-size batch: the global batch, and so the losses (up to\n"
        "rounding), do not depend on the number of processes or the layout. Exceptions under --fsdp/--hsdp: dion2\n"
        "(it selects rows there, the shorter side on one process) and --selection-scope local. Rank 0 writes the\n"
        "files. Checkpoints hold whole tensors: --resume continues a run under any layout and number of\n"
        "processes, or on one process.")
    layout = procs.add_mutually_exclusive_group()
    layout.add_argument("--ddp", action="store_const", const="ddp", dest="parallel",
                        help="DDP: the whole model on every process, gradients averaged; each process "
                             "orthogonalizes a share of the matrices (the default under torchrun)")
    layout.add_argument("--fsdp", action="store_const", const="fsdp", dest="parallel",
                        help="FSDP2 (fully_shard) over all processes: the rows of every parameter, their "
                             "gradients and optimizer state are sharded; the orthonormal optimizers exchange "
                             "rows over the same mesh")
    layout.add_argument("--hsdp", type=_mesh_shape, metavar="R,S",
                        help="FSDP2 on an R x S mesh: R replicas, each sharded over S processes (R*S = number of "
                             "processes); gradients are averaged over all, rows exchanged within a replica")


# ------------------------------------------------------------------------------------ configuration
def resolve_config(given: dict[str, Any]) -> TrainConfig:
    """Preset, then the options given, over the TrainConfig defaults; checked as a whole."""
    values = asdict(TrainConfig())
    values.update(PRESETS[given.get("preset", "cpu")])
    for f in fields(TrainConfig):
        if f.name in given:
            values[f.name] = given[f.name]
    lr = given.get("lr")
    if isinstance(lr, float):
        values["lr"] = dict.fromkeys(values["optimizers"], lr)
        if "scalar_lr" not in given and any(name != "adamw" for name in values["optimizers"]):
            # One --lr is each optimizer's own lr; the AdamW groups of the orthonormal ones keep AdamW's
            # default, whether or not adamw is in the comparison (it once took --lr only when it was).
            values["scalar_lr"] = DEFAULT_LR["adamw"]
    if "scalar_lr" in given and all(name == "adamw" for name in values["optimizers"]):
        raise UsageError("--scalar-lr sets the AdamW groups of the orthonormal optimizers, and this run trains "
                         "only adamw; its learning rate is --lr")
    values.update(_absolute_paths(values))
    cfg = TrainConfig.from_dict(values)
    check_config(cfg)
    return cfg.resolved()


def _absolute_paths(values: dict[str, Any]) -> dict[str, str]:
    """--data and --cache-dir as absolute paths, so that config.json, --resume and the reproduce
    command mean the same files from any working folder."""
    return {k: str(Path(values[k]).expanduser().absolute()) for k in ("data", "cache_dir") if values.get(k)}


def check_config(cfg: TrainConfig) -> None:
    if cfg.d_model % cfg.n_head:
        raise UsageError(f"--d-model {cfg.d_model} is not a multiple of --n-head {cfg.n_head}")
    if cfg.positions == "rope" and (cfg.d_model // cfg.n_head) % 2:
        raise UsageError(f"rope needs an even head size; d_model/n_head = {cfg.d_model // cfg.n_head}")
    if cfg.selection_scope not in ("global", "local"):
        raise UsageError(f"--selection-scope {cfg.selection_scope!r} must be 'global' or 'local'")
    for name in ("fraction", "rank_fraction"):
        if not 0 < getattr(cfg, name) <= 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be in (0, 1]")
    if cfg.warmup + cfg.cooldown > 1:
        raise UsageError(f"--warmup {cfg.warmup} + --cooldown {cfg.cooldown} exceeds 1 (shares of the steps)")
    if cfg.corpus_mb <= 0:
        raise UsageError("--corpus-mb must be > 0")
    extra = sorted(set(cfg.lr) - set(cfg.optimizers))
    if extra:
        raise UsageError(f"--lr names {', '.join(extra)}, which this run does not train")
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        raise UsageError(f"--device {cfg.device!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {cfg.device}: CUDA is not available to this torch ({torch.__version__}); "
                         "use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {cfg.device}: only cpu and cuda are supported")


def load_dataset(cfg: TrainConfig) -> datamod.Dataset:
    try:
        if cfg.data is None:
            dataset = datamod.builtin_corpus(cfg.cache_dir, cap_bytes=int(cfg.corpus_mb * 2**20))
        else:
            dataset = datamod.load_data(cfg.data)
        datamod.check_fits(dataset, cfg.context)
    except datamod.DataError as e:
        raise CommandError(str(e)) from None
    except OSError as e:
        raise CommandError(f"reading data: {e}") from None
    if cfg.vocab_size is not None:
        # Against the largest id read, not the rounded default: any vocabulary that holds every id works
        # (a later shard's larger id stops the run when a batch meets it).
        largest = dataset.largest_token
        if largest is None:  # text: bytes, read here (a pass over memory, no second read of the files)
            largest = max(datamod.max_token_id(t) for t in [*dataset.train, *dataset.val])
        if cfg.vocab_size <= largest:
            raise UsageError(f"--vocab-size {cfg.vocab_size} does not hold the data's token {largest}; "
                             f"give at least {largest + 1}")
        dataset.set_vocabulary(cfg.vocab_size)
    return dataset


# ------------------------------------------------------------------------------------ the command
def run(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k not in ("run", "command")}
    if "resume" in given:
        out_dir = Path(given["resume"])
        config_file = out_dir / "config.json"
        if not config_file.exists():
            raise CommandError(f"--resume {out_dir}: no config.json there; is it an `orthoptim train` output folder?")
        extra = sorted(set(given) - RESUME_OPTIONS - {"resume"})
        if extra:
            names = ", ".join("--" + k.replace("_", "-") for k in extra)
            raise UsageError(f"--resume continues the run exactly as {config_file} says; drop {names}")
        try:
            saved = json.loads(config_file.read_text())
            values = saved["config"]
            changed = {k: v for k, v in given.items() if k in ("device", "cache_dir")}
            if "device" in changed and values.get("autocast") == "auto":
                # "auto" means bf16 autocast on CUDA only: moving the run to another kind of device keeps
                # the precision it trained in.
                values = {**values, "autocast": effective_autocast(values["autocast"], values["device"])}
            cfg = TrainConfig.from_dict({**values, **changed, **_absolute_paths(changed)})
        except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise CommandError(f"--resume {out_dir}: {config_file} cannot be read as this command's configuration "
                               f"({type(e).__name__}: {e}); `orthoptim train` writes it: do not edit it") from None
        check_config(cfg)
        data_digest = saved.get("data_sha256")
        earlier = [*saved.get("earlier_environments", []), *([saved["environment"]] if "environment" in saved else [])]
    else:
        cfg = resolve_config(given)
        out_dir = Path(given.get("out") or time.strftime("runs/train-%Y%m%d-%H%M%S"))
        if any(checkpoint_path(out_dir, n).exists() for n in OPTIMIZERS):
            raise UsageError(f"--out {out_dir} already holds a run; continue it with --resume {out_dir} "
                             "or choose another --out")
        check_out_dir(out_dir)  # created by rank 0 in compare, once the layout is known to work
        data_digest, earlier = None, []
    stop_at = given.get("stop_at")
    if stop_at is not None and stop_at >= cfg.steps:
        raise UsageError(f"--stop-at {stop_at} must be smaller than --steps {cfg.steps}")
    quiet = given.get("quiet", False)
    plot = not given.get("no_plot", False)
    if plot and not plots_available():
        print("orthoptim train: matplotlib is not installed, so no loss.png (pip install 'orthoptim[plot]')",
              file=sys.stderr)
        plot = False

    if "threads" in given:
        torch.set_num_threads(given["threads"])
    mode = "hsdp" if "hsdp" in given else given.get("parallel")
    rank, parallel = start_distributed(cfg, mode, given.get("hsdp"))
    try:
        compare(cfg, out_dir, stop_at=stop_at, quiet=quiet or rank != 0, plot=plot, rank=rank, parallel=parallel,
                data_digest=data_digest, earlier_environments=earlier)
        if dist.is_initialized():
            # No rank closes its connections while another still has a collective in flight: gloo
            # aborts a process (SIGABRT) whose peer hangs up mid-transfer. Only on success: after an
            # error the other ranks may never reach a barrier.
            dist.barrier()
    except KeyboardInterrupt:
        saved = (f"the last checkpoint (every {cfg.save_every} steps)" if cfg.save_every else
                 "the optimizers that finished (--save-every 0 checkpoints only at the end: the interrupted "
                 "one starts again)")
        if (out_dir / "config.json").exists():
            print(f"\northoptim train: interrupted; continue from {saved} with: orthoptim train --resume {out_dir}",
                  file=sys.stderr)
        else:  # before the run wrote its config (reading or building the data): nothing to resume
            print("\northoptim train: interrupted before training started; nothing to resume", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def start_distributed(cfg: TrainConfig, mode: str | None = None,
                      hsdp: tuple[int, int] | None = None) -> tuple[int, Parallel | None]:
    """Under torchrun (WORLD_SIZE > 1): join the process group and set up the layout ``mode`` ("ddp",
    the default, "fsdp" or "hsdp" with ``hsdp`` = (replicas, shards)). Returns this process's rank and
    the layout (None on one process). Options that cannot work are refused before anything starts."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    flag = f"--{mode}" + (f" {hsdp[0]},{hsdp[1]}" if mode == "hsdp" and hsdp else "")
    if world_size <= 1:
        if mode is not None:
            launch = f"torchrun --standalone --nproc_per_node N -m orthoptim.cli train {flag} ..."
            raise UsageError(f"{flag} needs several processes; launch with {launch} "
                             f"(WORLD_SIZE is {os.environ.get('WORLD_SIZE', 'unset')})")
        return 0, None
    if cfg.batch_size % world_size:
        raise UsageError(f"--batch-size {cfg.batch_size} is not a multiple of the {world_size} processes")
    if mode == "hsdp" and hsdp is not None and hsdp[0] * hsdp[1] != world_size:
        replicas = next((r for r in range(2, world_size) if world_size % r == 0), 1)  # a valid example
        raise UsageError(f"{flag} needs {hsdp[0]}x{hsdp[1]} = {hsdp[0] * hsdp[1]} processes but torchrun started "
                         f"{world_size}; choose R,S with R*S = {world_size}, "
                         f"e.g. --hsdp {replicas},{world_size // replicas}")
    cuda = torch.device(cfg.device).type == "cuda"
    if mode == "hsdp" and not cuda and torch.__version__ < CPU_HSDP_MIN_TORCH:
        raise UsageError(f"{flag} on CPU needs torch >= {CPU_HSDP_MIN_TORCH} (this is {torch.__version__}); "
                         "use --fsdp or --ddp")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), make_parallel(mode or "ddp", device, hsdp)


def compare(cfg: TrainConfig, out_dir: Path, *, stop_at: int | None, quiet: bool, plot: bool, rank: int,
            parallel: Parallel | None = None, data_digest: str | None = None,
            earlier_environments: list[dict] | None = None) -> None:
    """Train each optimizer of ``cfg`` in turn; rank 0 writes the results after each one. ``data_digest``
    (a resumed run's): the data must still be the data it trained on. ``earlier_environments``: those
    of the jobs a resumed run ran in before, kept in the record where they differ from this one's."""
    dataset = load_dataset(cfg)
    digest = dataset.digest()
    if data_digest is not None and digest != data_digest:
        raise CommandError(f"--resume {out_dir}: the data ({dataset.description}) is not the data this run trained "
                           f"on (SHA-256 {data_digest[:12]}… then, {digest[:12]}… now); restore it, or start a new "
                           "run on the new data")
    command = reproduce_command(cfg, str(out_dir))
    layout = "single process" if parallel is None else parallel.mode
    if parallel is not None and parallel.mode == "hsdp":
        layout += " {}x{}".format(*parallel.mesh.shape)
    header = {"command": command, "config": asdict(cfg), "data": dataset.description, "data_sha256": digest,
              "environment": {**environment(cfg.device), "processes": int(os.environ.get("WORLD_SIZE", "1")),
                              "parallel": layout}}
    # A run resumed under another layout, on another machine or in another dtype says so: each job's
    # environment where it differs from the one after it (this one's last).
    chain = [*(earlier_environments or []), header["environment"]]
    earlier = [env for env, after in itertools.pairwise(chain) if env != after]
    if earlier:
        header["earlier_environments"] = earlier
    if rank == 0:
        check_out_dir(out_dir, create=True)
        # A resumed run's record is rewritten once it has trained: a refused resume leaves it as it was.
        if data_digest is None:
            write_json(out_dir / "config.json", header)
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"data: {dataset.description}")
    say(f"output: {out_dir}   reproduce: {command}")

    runs: dict[str, dict] = {}
    started = time.perf_counter()
    for name in cfg.optimizers:
        # The previous run's model and optimizer may be held by reference cycles: freed now, so that
        # this run's CUDA peak memory (reset when it starts) does not count them.
        gc.collect()
        progress = Progress(cfg.steps, enabled=not quiet)
        try:
            runs[name] = train(name, cfg, dataset, out_dir, stop_at=stop_at, progress=progress, parallel=parallel)
        except FloatingPointError as e:
            # The library's advice names its own option; this command's are --lr and --clip.
            what = getattr(e, "what", None)
            fix = "Lower --lr or --scalar-lr" + (", or set --clip" if not cfg.clip else "")
            message = f"{what}. {fix}" if what else str(e)
            raise CommandError(f"{name}: {message}") from None
        except datamod.DataError as e:  # e.g. a later shard holds a token beyond the vocabulary
            raise CommandError(str(e)) from None
        except CheckpointError as e:
            raise CommandError(f"{name}: {e}") from None
        if rank == 0:
            if data_digest is not None:
                write_json(out_dir / "config.json", header)
            write_results(out_dir, header, runs, started)
    if rank != 0:
        return
    wall = time.perf_counter() - started
    table = summary_table(runs)
    if plot:
        title = f"orthoptim train: {dataset.description.split(':')[0]}, {next(iter(runs.values()))['parameters']:,} " \
                f"parameters, {cfg.steps} steps of {cfg.batch_size}x{cfg.context} tokens"
        plot_losses(runs, out_dir / "loss.png", title)
    write_text(out_dir / "summary.txt", table + "\n")
    print(table)
    finished = all(r["finished"] for r in runs.values())
    reached = ", ".join(sorted({str(r["steps"]) for r in runs.values()}))
    note = "" if finished else f" (stopped at step {reached}; continue with: orthoptim train --resume {out_dir})"
    print(f"\n{len(runs)} run(s) in {wall / 60:.1f} min{note}. Results: {out_dir / 'results.json'}"
          + (f", plot: {out_dir / 'loss.png'}" if plot else ""))


def write_results(out_dir: Path, header: dict, runs: dict[str, dict], started: float) -> None:
    """results.json after every optimizer, so an interrupted comparison keeps what it finished."""
    write_json(out_dir / "results.json", {**header, "wall_time_s": time.perf_counter() - started, "runs": runs})


def summary_table(runs: dict[str, dict]) -> str:
    """One row per optimizer; Δ loss and optimizer time relative to Muon (or the first optimizer)."""
    ref_name = "muon" if "muon" in runs else next(iter(runs))
    ref = runs[ref_name]
    head = ["optimizer", "lr", "val loss", "bits/byte", f"Δ vs {ref_name}", "tokens/s", "opt ms/step", "opt share",
            f"opt vs {ref_name}", "state MB", "peak MB", "train time"]
    rows = []
    for name, r in runs.items():
        bpb = f"{r['final_val_bpb']:.3f}" if r["final_val_bpb"] is not None else "-"
        minutes, seconds = divmod(int(r["train_time_s"]), 60)
        rows.append([name, f"{r['lr']:g}", f"{r['final_val_loss']:.4f}", bpb,
                     f"{r['final_val_loss'] - ref['final_val_loss']:+.4f}",
                     f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
                     f"{r['opt_ms_median']:.1f}", f"{r['opt_share']:.1%}" if r["opt_share"] is not None else "-",
                     f"{r['opt_ms_median'] / ref['opt_ms_median']:.2f}x", f"{r['optimizer_state_mb']:.1f}",
                     f"{r['peak_memory_mb']:.0f}", f"{minutes}:{seconds:02d}"])
    kinds = {r["peak_memory_kind"] for r in runs.values()}
    notes = [f"val loss: nats/token at the last step; peak MB: {', '.join(sorted(kinds))}; train time excludes "
             "evaluation; opt ms/step and opt share (of the whole step) are medians over steps"]
    if not all(r["finished"] for r in runs.values()):
        stale = ", ".join(f"{name} evaluated at step {r['history']['val_step'][-1]}, stopped at {r['steps']}"
                          for name, r in runs.items()
                          if r["history"]["val_step"] and r["history"]["val_step"][-1] != r["steps"])
        notes.append("some runs stopped early (--stop-at): numbers are at the step they reached"
                     + (f"; val loss is that of the last evaluation ({stale})" if stale else ""))
    return format_table(head, rows) + "\n" + "\n".join(notes)
