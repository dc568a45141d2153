"""``param_groups(model)``: which parameters get an orthonormal rule; ``explain(optimizer)``: what each gets.

Embeddings and output heads are matrices, but orthonormal updates suit neither (their rows are
looked up or scored one token at a time), so they go to AdamW with every vector parameter.
They are found by module type and tensor identity (tied weights), and by name only for the last
layer of a model without a vocabulary (a classifier).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from orthoptim.optim.base import OrthonormalOptimizer
from orthoptim.optim.validation import MATRIX_ALGORITHMS
from orthoptim.rules.lr_scale import lr_scale
from orthoptim.rules.selection import ceil_fraction

_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
_CONV_TRANSPOSE_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, *_CONV_TRANSPOSE_TYPES)
# A layer's weight under its own name and under the names older reparametrizations give it:
# nn.utils.weight_norm's direction (weight_v), nn.utils.spectral_norm's and prune's weight_orig.
_WEIGHT_NAMES = ("weight", "weight_v", "weight_orig")


# Names under which models register their output head (the last part of the module's name).
_HEAD_NAMES = {"head", "lm_head", "output", "output_head", "out_head", "unembed", "unembedding", "decoder",
               "classifier", "logits"}


# Names of classification heads (any part of the module's qualified name: ``heads.head``, VGG's
# ``classifier.6``, ResNet's ``fc``), for models without a vocabulary to score.
_CLASSIFIER_NAMES = {"head", "heads", "lm_head", "classifier", "output_head", "out_head", "fc"}
VOCABULARY_HEAD = "output head (outputs one score per vocabulary entry)"
CLASSIFIER_HEAD = "output head (the model's last nn.Linear, named like a classifier)"


def _output_heads(model: nn.Module, vocabularies: dict[int, set[int]]) -> dict[int, str]:
    """id of each output head's weight → why: the nn.Linear layers producing one score per entry of an
    embedding's vocabulary (``vocabularies``: vocabulary size → the widths of the embeddings of that
    size). Every one whose outputs no nn.Linear reads (wider ones are hidden activations; several:
    multi-token prediction heads, or one head per vocabulary); when an MLP is as wide as the vocabulary
    (every such size is read), those named like a head, else the model's last nn.Linear if it is one
    of them and reads vectors as wide as that embedding's (an MLP's down-projection reads wider ones).
    Without any (a classifier, a ViT): the model's last nn.Linear when its name says it is a
    classifier, as Muon's authors keep the last layer on AdamW."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    candidates = [(name, m) for name, m in linears if m.out_features in vocabularies]
    if candidates:
        read_sizes = {m.in_features for _, m in linears}
        unread = [m for _, m in candidates if m.out_features not in read_sizes]
        named = [m for name, m in candidates if name.rsplit(".", 1)[-1] in _HEAD_NAMES]
        final = linears[-1][1]
        last = [final] if final is candidates[-1][1] and final.in_features in vocabularies[final.out_features] else []
        if heads := unread or named or last:
            return {id(m.weight): VOCABULARY_HEAD for m in heads}
    # No layer scores a vocabulary (or a hidden width merely equals an embedding's size, as learned
    # positions of max_len = d_model do): a classifier head, if the last layer is named like one.
    if linears and _CLASSIFIER_NAMES & set(linears[-1][0].split(".")):
        return {id(linears[-1][1].weight): CLASSIFIER_HEAD}
    return {}


# Names of tables (position embeddings, learned tokens) that models keep as bare parameters.
_EMBEDDING_LIKE = re.compile(r"emb|(^|_)(pos|position|positional|relative_position)(_|$)|(^|_)tokens?(_|$)")
# Weights that stack several projections' rows (kind → how many): split_sizes keeps them apart.
_STACKED_BLOCKS = {"qkv": 3, "lstm_gates": 4, "gru_gates": 3}
# weight_ih, weight_hh_l1_reverse…; _v and _orig: under nn.utils.weight_norm and spectral_norm.
_RECURRENT_WEIGHT = re.compile(r"weight_(ih|hh)(_l\d+(_reverse)?)?(_v|_orig)?")


def _stacked_gates(module: nn.Module, pname: str) -> str | None:
    """The kind of a recurrent layer's input or hidden weight that stacks its gates' rows (LSTM: i, f,
    g, o; GRU: r, z, n), or None. nn.RNN has one gate; an LSTM's projection weight_hr is one matrix."""
    if not _RECURRENT_WEIGHT.fullmatch(pname):
        return None
    if isinstance(module, (nn.LSTM, nn.LSTMCell)):
        return "lstm_gates"
    if isinstance(module, (nn.GRU, nn.GRUCell)):
        return "gru_gates"
    return None


def _parametrized_owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id of each ParametrizationList (torch.nn.utils.parametrize, e.g. weight_norm) → the module
    and tensor name it parametrizes: a conv's weight lives there, not on the conv."""
    owners = {}
    for module in model.modules():
        for name, plist in getattr(module, "parametrizations", {}).items():
            owners[id(plist)] = (module, name)
    return owners


def _fused_qkv_conv1d(model: nn.Module) -> set[int]:
    """ids of GPT-2 (Hugging Face) ``c_attn`` Conv1D layers that hold q, k and v side by side: their
    attention module says so with ``split_size`` (its width), and they are three of it wide."""
    found = set()
    for module in model.modules():
        child, split = getattr(module, "c_attn", None), getattr(module, "split_size", None)
        if type(child).__name__ == "Conv1D" and isinstance(split, int) and getattr(child, "nf", None) == 3 * split:
            found.add(id(child))
    return found


def _classify(model: nn.Module, include_frozen: bool = False) -> dict[int, tuple[str, str]]:
    """id(param) → (kind, reason) for every trainable parameter (every one with ``include_frozen``);
    kinds: matrix, conv, conv_transpose, in_out (stored [in, out]), in_out_qkv (GPT-2's c_attn: both),
    qkv (a fused in_proj_weight),
    lstm_gates and gru_gates (a recurrent layer's stacked gate weights) and scalar."""
    embeddings: dict[int, str] = {}
    sparse: set[int] = set()
    vocabularies: dict[int, set[int]] = {}
    for mname, module in model.named_modules():
        if isinstance(module, _EMBEDDING_TYPES):
            embeddings[id(module.weight)] = mname or "<root>"
            if module.sparse:
                sparse.add(id(module.weight))
            vocabularies.setdefault(module.num_embeddings, set()).add(module.embedding_dim)
    heads = _output_heads(model, vocabularies)
    owners = _parametrized_owners(model)
    fused_qkv = _fused_qkv_conv1d(model)
    kinds: dict[int, tuple[str, str]] = {}
    for mname, module in model.named_modules():
        # A parametrized weight (weight_norm's direction, original1) counts as its owner's weight.
        owner, owned = owners.get(id(module), (module, None))
        for pname, p in module.named_parameters(recurse=False):
            # Frozen integer tensors (packed quantized weights, counters) can never train: never included.
            if (not p.requires_grad and not (include_frozen and p.is_floating_point())) or id(p) in kinds:
                continue
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(p, nn.parameter.UninitializedParameter):
                # Its shape is unknown until the first forward (it reads as 1-D): it would go to AdamW.
                raise ValueError(
                    f"parameter {name} of a lazy module (e.g. nn.LazyLinear) is not initialized yet, so its "
                    "shape and rule are unknown; run one forward pass with a dummy batch before param_groups()")
            if id(p) in sparse:
                raise ValueError(
                    f"parameter {name} is the weight of an embedding built with sparse=True; orthoptim needs "
                    "dense gradients: build it with sparse=False, or leave it out here (requires_grad_(False) "
                    "while param_groups() runs, without include_frozen=True) and give it to torch.optim.SparseAdam")
            if id(p) in embeddings:
                tied = " (tied to the output head)" if id(p) in heads else ""
                kinds[id(p)] = ("scalar", f"embedding of {embeddings[id(p)]}{tied}")
            elif id(p) in heads:
                kinds[id(p)] = ("scalar", heads[id(p)])
            elif p.ndim < 2:
                kinds[id(p)] = ("scalar", "vector (bias or norm)")
            elif sum(size > 1 for size in p.shape) < 2:
                # (1, 1, d) tokens and biases, (n, 1) magnitudes of weight_norm: an orthonormal update of
                # one row or column is its sign pattern scaled to unit norm, blind to its size.
                kinds[id(p)] = ("scalar", f"vector-shaped {tuple(p.shape)}")
            elif isinstance(module, nn.MultiheadAttention) and pname == "in_proj_weight":
                kinds[id(p)] = ("qkv", "attention in_proj_weight: q, k and v orthogonalized apart (split_sizes)")
            elif (gates := _stacked_gates(owner, owned or pname)) is not None:
                kinds[id(p)] = (gates, f"recurrent {owned or pname}: its {_STACKED_BLOCKS[gates]} gates' "
                                       "weights orthogonalized apart (split_sizes)")
            elif isinstance(owner, _CONV_TRANSPOSE_TYPES) and (owned or pname) in _WEIGHT_NAMES:
                # Stored [in, out/groups, k…]: flattened and read transposed, its rows are outputs.
                kinds[id(p)] = ("conv_transpose", "transposed-conv weight [in, out, k…], read as [out·k…, in]")
            elif isinstance(owner, _CONV_TYPES) and (owned or pname) in _WEIGHT_NAMES:
                kinds[id(p)] = ("conv", "conv weight, flattened to [out, in·k…]")
            elif type(module).__name__ == "Conv1D" and pname in _WEIGHT_NAMES and p.ndim == 2 and \
                    getattr(module, "nf", None) == p.shape[1]:
                # GPT-2's (Hugging Face) Conv1D is a linear layer that stores its weight [in, out].
                if id(module) in fused_qkv:
                    kinds[id(p)] = ("in_out_qkv", "GPT-2 attention c_attn stored [in, out], read transposed: q, k "
                                                  "and v orthogonalized apart (split_sizes)")
                else:
                    kinds[id(p)] = ("in_out", "Conv1D weight stored [in, out] (x @ W), read transposed")
            elif owned is None and pname not in _WEIGHT_NAMES and _EMBEDDING_LIKE.search(pname):
                # A table a module keeps as a bare nn.Parameter (ViT's pos_embed (1, N, d), register tokens,
                # Swin's relative_position_bias_table): an embedding, not a linear map. (By name only: a
                # (1, d, h) stack of one key head or one expert is a linear map.)
                kinds[id(p)] = ("scalar", "a module's own parameter named like an embedding, a position table or "
                                          "learned tokens: a table, not a linear map")
            elif p.ndim in (2, 3):
                kinds[id(p)] = ("matrix", "matrix" if p.ndim == 2 else "batch of matrices")
            else:
                kinds[id(p)] = ("scalar", f"{p.ndim}-D tensor outside a conv module")
    return kinds


def param_groups(
    model: nn.Module,
    *,
    algorithm: str | None = None,
    scalar_algorithm: str = "adamw",
    scalar_lr: float | None = None,
    scalar_weight_decay: float | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    include_frozen: bool = False,
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into optimizer groups.

    Parameters with ``requires_grad=False`` are left out (a frozen backbone takes no state), so a
    layer frozen now is never trained, even once unfrozen: for gradual unfreezing pass
    ``include_frozen=True`` (frozen parameters then get their state, and are skipped while they have
    no gradient).

    - matrices (``nn.Linear`` weights, 3-D batches of matrices) → the optimizer's own rule
      (or ``algorithm`` when given); conv weights (also weight_norm's direction) → the same rule with
      ``flatten=True`` (transposed convs, stored [in, out, k…], also ``transpose=True``); weights
      stored [in, out] by GPT-2's ``Conv1D`` with ``transpose=True`` (which runs on whole matrices:
      to shard them with FSDP2, ``overrides={"*.c_*": {"transpose": False}}``), its attention's fused
      ``c_attn`` (three of its module's ``split_size`` wide) also with ``split_sizes`` [e, e, e];
      ``nn.MultiheadAttention``'s fused ``in_proj_weight`` with ``split_sizes`` [e, e, e] (q, k, v
      apart), and LSTM/GRU (and their cells') ``weight_ih``/``weight_hh`` with one block per gate
      ([h]·4, [h]·3);
    - embeddings (also tables kept as bare parameters named like ``pos_embed`` or ``*_tokens``), output
      heads (tied or not; every Linear scoring an embedding's vocabulary, or else the model's last
      Linear when it is named like a classifier: ``head``, ``classifier``, ``fc``), biases,
      norms and other tensors with at most one dimension above 1 → ``scalar_algorithm`` ("adamw" or
      "lion"), with ``lr=scalar_lr`` and ``weight_decay=scalar_weight_decay`` when given; otherwise
      they take the optimizer's ``lr`` and ``weight_decay`` like every group (pass
      ``scalar_weight_decay=0.0`` for the common choice of no decay on embeddings, norms and biases);
    - ``overrides`` maps name patterns (``fnmatch``, e.g. ``"*.qkv.weight"``) to group options
      (``{"split_sizes": [512, 128, 128]}``, ``{"algorithm": "adamw"}``…); the first matching
      pattern wins and its options are applied on top.

    Every group carries ``param_names`` (so errors and ``explain`` name parameters) and a ``name``
    that says why its parameters are there.
    """
    if scalar_algorithm not in ("adamw", "lion"):
        raise ValueError(f"scalar_algorithm={scalar_algorithm!r} must be 'adamw' or 'lion'")
    if algorithm is not None and algorithm not in (*MATRIX_ALGORITHMS, "adamw", "lion"):
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {[*MATRIX_ALGORITHMS, 'adamw', 'lion']}")
    overrides = dict(overrides or {})
    for pattern, options in overrides.items():
        if not isinstance(options, Mapping):
            raise ValueError(f"overrides[{pattern!r}]={options!r} must be a dict of group options, "
                             "e.g. {'algorithm': 'adamw'} or {'split_sizes': [512, 128, 128]}")
    kinds = _classify(model, include_frozen)
    groups: dict[tuple, dict[str, Any]] = {}
    used_patterns: set[str] = set()
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in kinds or id(p) in seen:
            continue
        seen.add(id(p))
        kind, _reason = kinds[id(p)]
        options: dict[str, Any] = {}
        if kind == "scalar":
            options["algorithm"] = scalar_algorithm
            if scalar_lr is not None:
                options["lr"] = scalar_lr
            if scalar_weight_decay is not None:
                options["weight_decay"] = scalar_weight_decay
        elif algorithm is not None:
            options["algorithm"] = algorithm
        pattern = next((pat for pat in overrides if fnmatch.fnmatchcase(name, pat)), None)
        if pattern is not None:
            used_patterns.add(pattern)
            options.update(overrides[pattern])
        # A conv weight is flattened to 2-D for a matrix rule (its algorithm after any override; None:
        # the optimizer's own), never for AdamW/Lion, which read no such option.
        matrix_rule = options.get("algorithm") not in ("adamw", "lion")
        if kind in ("conv", "conv_transpose") and "flatten" not in options and matrix_rule:
            options["flatten"] = True
        if kind in ("conv_transpose", "in_out", "in_out_qkv") and "transpose" not in options and matrix_rule:
            options["transpose"] = True
        # nn.MultiheadAttention keeps q, k and v stacked in one [3e, e] weight, LSTM and GRU layers their
        # gates in [4h, ·] and [3h, ·] ones: as that many projections.
        if kind in _STACKED_BLOCKS and "split_sizes" not in options and matrix_rule:
            options["split_sizes"] = [p.shape[0] // _STACKED_BLOCKS[kind]] * _STACKED_BLOCKS[kind]
        # GPT-2's c_attn, read transposed, has q, k and v as its rows' three blocks (read as stored,
        # [in, 3e], they would be column blocks, which split_sizes does not cut: one matrix then).
        if kind == "in_out_qkv" and "split_sizes" not in options and matrix_rule and options.get("transpose"):
            options["split_sizes"] = [p.shape[1] // 3] * 3
        label = pattern or kind
        key = (label, tuple(sorted((k, repr(v)) for k, v in options.items())))
        group = groups.setdefault(key, {"name": label, "params": [], "param_names": [], **options})
        group["params"].append(p)
        group["param_names"].append(name)
    unused = sorted(set(overrides) - used_patterns)
    if unused:
        # A tied weight is listed once, under its first name: say which name a pattern should use.
        first_name = {id(q): n for n, q in model.named_parameters()}
        tied = sorted({f"{n} is tied to {first_name[id(q)]}" for n, q in model.named_parameters(remove_duplicate=False)
                       if first_name.get(id(q)) != n and any(fnmatch.fnmatchcase(n, u) for u in unused)})
        hint = f" ({'; '.join(tied)}: use that name)" if tied else ""
        raise ValueError(f"overrides pattern(s) {unused} matched no trainable parameter{hint}; check the names "
                         "with [n for n, _ in model.named_parameters()]")
    return list(groups.values())


def describe_assignment(model: nn.Module, include_frozen: bool = False) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, shape, kind, reason) per trainable parameter (every one with ``include_frozen``): how
    ``param_groups`` decided."""
    kinds = _classify(model, include_frozen)
    out = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in kinds and id(p) not in seen:
            seen.add(id(p))
            out.append((name, tuple(p.shape), *kinds[id(p)]))
    return out


def _state_bytes(state: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor) and v.ndim > 0)


def _number(value: Any) -> Any:
    """A tensor learning rate as a number (torch's optimizers also take one-element 1-D tensors)."""
    return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def explain(optimizer: torch.optim.Optimizer) -> str:
    """A table with one row per parameter: name, shape, rule, matrix view, lr·scale, weight decay, state bytes."""
    header = ("parameter", "shape", "rule", "matrix view", "lr x scale", "wd", "state bytes")
    rows = [header]
    total = 0
    for gi, group in enumerate(optimizer.param_groups):
        algorithm = group.get("algorithm", type(optimizer).__name__.lower())
        names = group.get("param_names") or [None] * len(group["params"])
        for j, p in enumerate(group["params"]):
            name = names[j] or (optimizer.param_name(p) if isinstance(optimizer, OrthonormalOptimizer)
                                else f"param_groups[{gi}].params[{j}]")
            state_bytes = _state_bytes(optimizer.state.get(p, {}))
            total += state_bytes
            if isinstance(optimizer, OrthonormalOptimizer) and algorithm in MATRIX_ALGORITHMS:
                view = optimizer._view(p, group)
                scales = sorted({lr_scale(r, c, group["adjust_lr"]) for r, c in view.block_shapes()})
                lr_text = ", ".join(f"{_number(group['lr']) * s:.3g}" for s in scales)
                view_text = view.describe()
                rule = algorithm
                if algorithm in ("dion3", "dion2"):
                    rule += f" f={group['fraction']:g}"
                elif algorithm == "dion":
                    ranks = sorted({max(1, ceil_fraction(group["rank_fraction"], min(shape)))
                                    for shape in view.block_shapes()})
                    rule += f" r={','.join(map(str, ranks))}"
            else:
                lr_text, view_text, rule = f"{_number(group['lr']):.3g}", "-", algorithm
            rows.append((name, str(list(p.shape)), rule, view_text, lr_text, f"{group.get('weight_decay', 0):g}",
                         f"{state_bytes:,}"))
    rows.append(("total", "", "", "", "", "", f"{total:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
