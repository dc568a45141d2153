"""``param_groups(model)``, ``describe_assignment(model)``, ``explain(optimizer)``, and a small model
trained with every optimizer.

The assignment rules under test (DESIGN.md §2, §4): matrices → the orthonormal rule; embeddings, the
output head (tied or not), biases and norms → AdamW (or Lion); conv weights → flatten=True; 3-D
tensors → batches of matrices; overrides by name pattern; each trainable parameter exactly once.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orthoptim

VOCAB, D = 40, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.experts = nn.Parameter(torch.randn(3, 2 * D, D) / 8)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)


def make(cls=TinyLM, **kwargs):
    torch.manual_seed(0)
    return cls(**kwargs)


def group_of(groups, p):
    hits = [g for g in groups for q in g["params"] if q is p]
    assert len(hits) == 1, f"in {len(hits)} groups"
    return hits[0]


def names_in(group):
    return list(group["param_names"])


def assert_partition(model, groups):
    """Every trainable parameter exactly once; frozen ones nowhere; names match tensors."""
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}  # tied: listed once
    listed = [id(p) for g in groups for p in g["params"]]
    assert len(listed) == len(set(listed)), "a parameter appears in two places"
    assert set(listed) == set(trainable)
    params = dict(model.named_parameters(remove_duplicate=False))
    for g in groups:
        assert len(g["param_names"]) == len(g["params"])
        for n, p in zip(g["param_names"], g["params"], strict=True):
            assert params[n] is p, f"param_names entry {n!r} does not name its tensor"


# ----------------------------------------------------------------------------- param_groups
def test_frozen_layers_are_left_out_unless_included_and_then_train_once_unfrozen():
    """Left out by default (a frozen layer takes no state; unfreezing it later trains nothing);
    with include_frozen=True grouped as if trainable, and stepped once they have gradients."""
    model = make()
    model.packed = nn.Parameter(torch.zeros(4, 4, dtype=torch.uint8), requires_grad=False)  # never trains
    assert not any("frozen" in row[0] for row in orthoptim.describe_assignment(model))
    groups = orthoptim.param_groups(model, include_frozen=True)
    assert not any(p is model.packed for g in groups for p in g["params"])
    assert group_of(groups, model.frozen.weight).get("algorithm") is None  # the optimizer's own rule
    assert group_of(groups, model.frozen.bias)["algorithm"] == "adamw"
    assert {"frozen.weight", "frozen.bias"} <= {row[0] for row in orthoptim.describe_assignment(model, True)}
    opt = orthoptim.Dion3(groups, lr=0.02)
    weight = model.frozen.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    opt.step()
    assert torch.equal(model.frozen.weight, weight)  # frozen: no gradient, no step
    model.frozen.requires_grad_(True)
    model.frozen.weight.grad = torch.randn_like(weight)
    opt.step()
    assert not torch.equal(model.frozen.weight, weight)


def test_untied_model_assignment():
    model = make()
    groups = orthoptim.param_groups(model)
    assert_partition(model, groups)
    scalar = {"emb.weight", "head.weight", "norm.weight", "norm.bias"}
    for i in range(2):
        scalar |= {f"blocks.{i}.norm.weight", f"blocks.{i}.norm.bias"}
        scalar |= {f"blocks.{i}.{m}.bias" for m in ("qkv", "proj", "fc", "out")}
    matrix = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc", "out")} | {"experts"}
    params = dict(model.named_parameters())
    for n in scalar:
        assert group_of(groups, params[n])["algorithm"] == "adamw", n
    for n in matrix:
        g = group_of(groups, params[n])
        assert "algorithm" not in g, f"{n} should take the optimizer's own rule"
        assert not g.get("flatten", False)
    assert not any("frozen" in n for g in groups for n in g["param_names"])
    assert {n for g in groups for n in g["param_names"]} == scalar | matrix


def test_tied_head_appears_once_in_adamw():
    model = make(tied=True)
    assert model.head.weight is model.emb.weight
    groups = orthoptim.param_groups(model)
    assert_partition(model, groups)
    hits = [(g, n) for g in groups for n, p in zip(g["param_names"], g["params"]) if p is model.emb.weight]
    assert len(hits) == 1
    assert hits[0][0]["algorithm"] == "adamw"
    reasons = {n: reason for n, _, _, reason in orthoptim.describe_assignment(model)}
    assert "tied" in reasons[hits[0][1]]
    assert "head.weight" not in reasons or reasons["head.weight"] == reasons["emb.weight"]


def test_head_is_found_by_module_type_not_by_name():
    """An untied output head called ``decoder`` (a Linear producing one score per vocabulary entry)
    still goes to AdamW; a Linear named ``head`` that is a hidden layer does not."""

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, D)
            self.head = nn.Linear(D, D)
            self.decoder = nn.Linear(D, VOCAB)

    model = make(Renamed)
    groups = orthoptim.param_groups(model)
    assert group_of(groups, model.decoder.weight)["algorithm"] == "adamw"
    assert group_of(groups, model.tok.weight)["algorithm"] == "adamw"
    assert "algorithm" not in group_of(groups, model.head.weight)


def test_hidden_linear_as_wide_as_the_vocabulary_is_not_a_head():
    class TokenClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D)
            self.up = nn.Linear(D, VOCAB)  # MLP width happens to equal the vocabulary size
            self.down = nn.Linear(VOCAB, D)
            self.classify = nn.Linear(D, 3)

    model = make(TokenClassifier)
    groups = orthoptim.param_groups(model)
    assert "algorithm" not in group_of(groups, model.up.weight)


def test_named_algorithm_and_scalar_options():
    model = make()
    groups = orthoptim.param_groups(model, algorithm="normuon", scalar_algorithm="lion", scalar_lr=3e-4)
    assert_partition(model, groups)
    for g in groups:
        for n, p in zip(g["param_names"], g["params"]):
            if p.ndim >= 2 and p is not model.emb.weight and p is not model.head.weight:
                assert g["algorithm"] == "normuon" and "lr" not in g, n
            else:
                assert g["algorithm"] == "lion" and g["lr"] == 3e-4, n
    opt = orthoptim.Dion3(groups, lr=0.02)
    lrs = {n: g["lr"] for g in opt.param_groups for n in g["param_names"]}
    assert lrs["emb.weight"] == 3e-4 and lrs["blocks.0.fc.weight"] == 0.02


def test_scalar_weight_decay_applies_to_the_scalar_groups_only():
    model = make()
    opt = orthoptim.Dion3(orthoptim.param_groups(model, scalar_weight_decay=0.0), weight_decay=0.1)
    decay = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert decay["emb.weight"] == decay["head.weight"] == decay["norm.bias"] == decay["blocks.0.fc.bias"] == 0.0
    assert decay["blocks.0.fc.weight"] == decay["experts"] == 0.1
    inherited = orthoptim.Dion3(orthoptim.param_groups(model), weight_decay=0.1)
    assert {g["weight_decay"] for g in inherited.param_groups} == {0.1}


def test_conv_weights_are_flattened_and_trainable():
    model = make(ConvNet)
    groups = orthoptim.param_groups(model)
    assert_partition(model, groups)
    g = group_of(groups, model.conv.weight)
    assert g["flatten"] is True and "algorithm" not in g
    assert group_of(groups, model.fc.weight).get("flatten", False) is False
    for p in (model.conv.bias, model.bn.weight, model.bn.bias):
        assert group_of(groups, p)["algorithm"] == "adamw"
    opt = orthoptim.Muon(groups, lr=0.02)
    before = model.conv.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(before, model.conv.weight)


def test_three_d_parameter_is_a_batch_of_matrices():
    model = make()
    groups = orthoptim.param_groups(model)
    g = group_of(groups, model.experts)
    assert "algorithm" not in g and not g.get("flatten", False)
    reasons = {n: (kind, reason) for n, _, kind, reason in orthoptim.describe_assignment(model)}
    assert reasons["experts"] == ("matrix", "batch of matrices")


def test_overrides_apply_options_by_pattern():
    model = make()
    groups = orthoptim.param_groups(model, overrides={
        "blocks.*.qkv.weight": {"split_sizes": [D, D, D], "num_heads": 2},
        "blocks.1.out.weight": {"algorithm": "adamw"},
        "blocks.*.out.weight": {"weight_decay": 0.0},  # later pattern: blocks.1.out.weight took the first
    })
    assert_partition(model, groups)
    for i in range(2):
        g = group_of(groups, model.blocks[i].qkv.weight)
        assert g["split_sizes"] == [D, D, D] and g["num_heads"] == 2
        assert "algorithm" not in g
        assert "split_sizes" not in group_of(groups, model.blocks[i].qkv.bias)
    g1 = group_of(groups, model.blocks[1].out.weight)
    assert g1["algorithm"] == "adamw" and "weight_decay" not in g1  # first matching pattern wins
    g0 = group_of(groups, model.blocks[0].out.weight)
    assert g0["weight_decay"] == 0.0 and "algorithm" not in g0
    assert "split_sizes" not in group_of(groups, model.blocks[0].proj.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key param_groups writes is a known group key
        opt = orthoptim.Dion3(groups)
    assert len(opt.state[model.blocks[1].out.weight]) == 3  # AdamW state: step, exp_avg, exp_avg_sq


def test_override_pattern_matching_nothing_raises():
    model = make()
    with pytest.raises(ValueError, match=re.escape("'blocks.*.attn.weight'")):
        orthoptim.param_groups(model, overrides={"blocks.*.qkv.weight": {"num_heads": 2},
                                                 "blocks.*.attn.weight": {"num_heads": 2}})
    with pytest.raises(ValueError, match="frozen"):  # frozen parameters cannot be matched either
        orthoptim.param_groups(model, overrides={"frozen.weight": {"algorithm": "adamw"}})


def test_an_override_naming_a_tied_weight_by_its_second_name_says_which_name_to_use():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(VOCAB, D)
            self.hidden = nn.Linear(D, D)
            self.lm_head = nn.Linear(D, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight

    with pytest.raises(ValueError, match=re.escape("lm_head.weight is tied to wte.weight: use that name")):
        orthoptim.param_groups(make(Tied), overrides={"lm_head.*": {"lr": 1e-3}})


def test_bad_algorithm_arguments_raise():
    model = make()
    with pytest.raises(ValueError, match="scalar_algorithm='sgd'"):
        orthoptim.param_groups(model, scalar_algorithm="sgd")
    with pytest.raises(ValueError, match="algorithm='muon2'"):
        orthoptim.param_groups(model, algorithm="muon2")


def test_describe_assignment_reasons():
    model = make()
    rows = {n: (shape, kind, reason) for n, shape, kind, reason in orthoptim.describe_assignment(model)}
    assert set(rows) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert rows["emb.weight"][1:] == ("scalar", "embedding of emb")
    assert rows["head.weight"][1] == "scalar" and "output head" in rows["head.weight"][2]
    assert rows["blocks.0.norm.weight"][1:] == ("scalar", "vector (bias or norm)")
    assert rows["blocks.0.qkv.weight"] == ((3 * D, D), "matrix", "matrix")
    conv = {n: (kind, reason) for n, _, kind, reason in orthoptim.describe_assignment(make(ConvNet))}
    assert conv["conv.weight"] == ("conv", "conv weight, flattened to [out, in·k…]")
    up = {n: (kind, reason) for n, _, kind, reason in orthoptim.describe_assignment(nn.ConvTranspose2d(8, 4, 2))}
    assert up["weight"] == ("conv_transpose", "transposed-conv weight [in, out, k…], read as [out·k…, in]")


# ----------------------------------------------------------------------------- explain
def parse_explain(text: str) -> list[list[str]]:
    lines = text.splitlines()
    assert re.fullmatch(r"[- ]+", lines[1]), "second line is the rule under the header"
    header = re.split(r"\s{2,}", lines[0].strip())
    assert header == ["parameter", "shape", "rule", "matrix view", "lr x scale", "wd", "state bytes"]
    return [re.split(r"\s{2,}", line.strip()) for line in lines[2:]]


def state_bytes(state) -> int:
    # The 0-d AdamW step counter is not counted by explain; every state tensor with a shape is.
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)


def test_explain_one_row_per_parameter():
    model = make()
    groups = orthoptim.param_groups(model, overrides={
        "blocks.*.qkv.weight": {"split_sizes": [D, D, D], "num_heads": 2},
        "blocks.0.fc.weight": {"algorithm": "dion", "rank_fraction": 0.5},
    })
    opt = orthoptim.Dion3(groups, lr=0.02, weight_decay=0.05)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    rows = parse_explain(orthoptim.explain(opt))
    assert rows[-1][0] == "total"
    body = {r[0]: r for r in rows[:-1]}
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(rows) - 1 == len(params) and set(body) == set(params)
    for name, p in params.items():
        cells = body[name]
        assert len(cells) == 7, cells
        assert cells[1] == str(list(p.shape))
        assert cells[5] == "0.05"
        assert int(cells[6].replace(",", "")) == state_bytes(opt.state[p]), name
        assert state_bytes(opt.state[p]) > 0
    total = sum(state_bytes(s) for s in opt.state.values())
    assert int(rows[-1][-1].replace(",", "")) == total

    qkv = body["blocks.0.qkv.weight"]
    assert qkv[2] == "dion3 f=0.25"
    assert qkv[3] == f"6 × [8, {D}]"  # 3 splits × 2 heads, each [8, 16]
    assert float(qkv[4]) == pytest.approx(0.02 * math.sqrt(8 / D), rel=1e-2)
    assert body["blocks.0.proj.weight"][3] == f"[{D}, {D}]"
    assert float(body["blocks.0.proj.weight"][4]) == pytest.approx(0.02, rel=1e-2)
    assert body["experts"][3] == f"3 × [{2 * D}, {D}]"
    assert float(body["experts"][4]) == pytest.approx(0.02 * math.sqrt(2), rel=1e-2)
    assert body["blocks.0.fc.weight"][2] == f"dion r={D // 2}"
    assert body["blocks.1.fc.weight"][2] == "dion3 f=0.25"
    for n in ("emb.weight", "head.weight", "norm.bias"):
        assert body[n][2:5] == ["adamw", "-", "0.02"], n
    # State sizes by hand for two rows: Dion3 keeps momentum (fp32) and one fp32 variance per row.
    assert state_bytes(opt.state[model.blocks[1].proj.weight]) == 4 * (D * D + D)
    assert state_bytes(opt.state[model.emb.weight]) == 4 * 2 * VOCAB * D


def test_explain_plain_torch_optimizer():
    model = make(ConvNet)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = parse_explain(orthoptim.explain(opt))
    assert len(rows) - 1 == len(list(model.parameters()))


# ----------------------------------------------------------------------------- training
# Measured (60 full-batch steps, the seeds below, initial loss 2.2987), final / initial loss:
# Dion3 0.069, Dion2 0.113, Dion (rank 1/2) 3.1e-4, Muon 1.0e-5, NorMuon 1.1e-5, AdamW 0.013.
# Each margin leaves ≥ 3× room for round-off and small rule changes, but not for an optimizer that
# learns slowly or not at all.
TRAIN_STEPS = 60
MARGINS = {"dion3": 0.25, "dion2": 0.35, "dion": 0.01, "muon": 1e-3, "normuon": 1e-3, "adamw": 0.05}
TRAIN_CASES = {
    "dion3": lambda m: orthoptim.Dion3(orthoptim.param_groups(m), lr=0.05),
    "dion2": lambda m: orthoptim.Dion2(orthoptim.param_groups(m), lr=0.05),
    "dion": lambda m: orthoptim.Dion(orthoptim.param_groups(m), lr=0.05, rank_fraction=0.5),
    "muon": lambda m: orthoptim.Muon(orthoptim.param_groups(m), lr=0.05),
    "normuon": lambda m: orthoptim.NorMuon(orthoptim.param_groups(m), lr=0.05),
    "adamw": lambda m: orthoptim.Muon(orthoptim.param_groups(m, algorithm="adamw"), lr=3e-3),
}


def teacher_data():
    """256 points in 32-D, labelled by a random linear teacher over 10 classes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen)
    y = (x @ torch.randn(32, 10, generator=gen)).argmax(1)
    return x, y


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_small_model_learns(name):
    x, y = teacher_data()
    model = mlp()
    opt = TRAIN_CASES[name](model)
    algorithms = {g["algorithm"] for g in opt.param_groups}
    assert algorithms == ({"adamw"} if name == "adamw" else {name, "adamw"})
    with torch.no_grad():
        initial = F.cross_entropy(model(x), y).item()
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        final = F.cross_entropy(model(x), y).item()
    assert math.isfinite(final)
    assert final < MARGINS[name] * initial, f"{name}: loss {initial:.4f} → {final:.4f}"


@pytest.mark.parametrize("head_name", ["head", "proj_out"])
def test_head_is_found_when_an_mlp_is_as_wide_as_the_vocabulary(head_name):
    """vocab 4·D: the MLP's hidden width equals the vocabulary, so every vocabulary-sized output is
    also read by a Linear. The head is still found: by its name, or as the model's last Linear."""

    class WideMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4 * D, D)
            self.fc = nn.Linear(D, 4 * D)
            self.down = nn.Linear(4 * D, D)
            self.add_module(head_name, nn.Linear(D, 4 * D, bias=False))

    model = make(WideMLP)
    head = getattr(model, head_name)
    groups = orthoptim.param_groups(model)
    assert group_of(groups, head.weight)["algorithm"] == "adamw"
    assert "algorithm" not in group_of(groups, model.fc.weight)


def test_a_hidden_layer_as_wide_as_the_vocabulary_before_a_small_head_stays_a_matrix():
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4 * D, D)
            self.fc = nn.Linear(D, 4 * D)
            self.down = nn.Linear(4 * D, D)
            self.classify = nn.Linear(D, 3)

    model = make(Classifier)
    assert "algorithm" not in group_of(orthoptim.param_groups(model), model.fc.weight)


def test_explain_names_each_block_size_and_dion_rank():
    """Fused blocks of two sizes: the view counts each size, and Dion shows the rank of each."""
    qkv = nn.Linear(D, 2 * D + D // 2, bias=False)  # q, k of D rows, v of D/2 rows
    opt = orthoptim.Dion([{"params": [qkv.weight], "param_names": ["qkv.weight"],
                           "split_sizes": [D, D, D // 2]}], rank_fraction=0.5)
    row = re.split(r"\s{2,}", orthoptim.explain(opt).splitlines()[2].strip())
    assert row[2] == f"dion r={D // 4},{D // 2}"
    assert row[3] == f"1 × [{D // 2}, {D}] + 2 × [{D}, {D}]"


def test_every_output_head_goes_to_adamw():
    """Several heads over one vocabulary (multi-token prediction) or one head per vocabulary: only the
    last one was found, the others were orthogonalized."""

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text = nn.Embedding(VOCAB, D)
            self.image = nn.Embedding(VOCAB + 7, D)
            self.hidden = nn.Linear(D, D)
            self.next_tokens = nn.ModuleList([nn.Linear(D, VOCAB, bias=False) for _ in range(3)])
            self.image_head = nn.Linear(D, VOCAB + 7)

    model = make(Heads)
    groups = orthoptim.param_groups(model)
    for head in [*model.next_tokens, model.image_head]:
        assert group_of(groups, head.weight)["algorithm"] == "adamw"
    assert "algorithm" not in group_of(groups, model.hidden.weight)


def test_vector_shaped_tensors_and_weight_norm_parts_are_grouped_by_what_they_are():
    """(1, 1, d) tokens and MultiheadAttention's bias_k were "batches of matrices"; weight_norm's
    magnitudes went to the matrix rule and a conv's direction was cut into one matrix per channel."""
    from torch.nn.utils.parametrizations import weight_norm

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
            self.attn = nn.MultiheadAttention(D, 2, add_bias_kv=True)
            self.conv = weight_norm(nn.Conv1d(8, D, 5))
            self.legacy = nn.utils.weight_norm(nn.Conv2d(3, 8, 3))  # weight_g / weight_v on the conv itself
            self.lin = weight_norm(nn.Linear(D, 12))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # nn.utils.weight_norm is deprecated
        model = make(Model)
    groups = orthoptim.param_groups(model)
    scalar = [model.cls_token, model.attn.bias_k, model.attn.bias_v, model.conv.parametrizations.weight.original0,
              model.legacy.weight_g, model.lin.parametrizations.weight.original0]
    for p in scalar:
        assert group_of(groups, p)["algorithm"] == "adamw", tuple(p.shape)
    for conv_weight in (model.conv.parametrizations.weight.original1, model.legacy.weight_v):
        assert group_of(groups, conv_weight).get("flatten") is True
    assert "algorithm" not in group_of(groups, model.lin.parametrizations.weight.original1)


def test_conv_weights_renamed_by_spectral_norm_and_pruning_are_flattened():
    """nn.utils.spectral_norm and nn.utils.prune keep a conv's weight as weight_orig: a Conv1d's was
    cut into one matrix per output channel, a Conv2d's went to AdamW as a 4-D tensor."""
    from torch.nn.utils import prune

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.spectral = nn.utils.spectral_norm(nn.Conv1d(4, 8, 3))
            self.spectral2d = nn.utils.spectral_norm(nn.Conv2d(8, D, 3))
            self.pruned = prune.l1_unstructured(nn.Conv2d(D, D, 3), "weight", amount=0.5)
            self.up = nn.utils.spectral_norm(nn.ConvTranspose2d(D, 8, 3))

    model = make(Model)
    groups = orthoptim.param_groups(model)
    for conv in (model.spectral, model.spectral2d, model.pruned):
        group = group_of(groups, conv.weight_orig)
        assert group.get("flatten") is True and not group.get("transpose"), conv
    up = group_of(groups, model.up.weight_orig)
    assert up.get("flatten") is True and up.get("transpose") is True


def test_a_plain_group_can_join_the_named_groups_of_param_groups():
    """torch.optim refuses groups with and without param_names side by side ("with/without names")."""
    model = make()
    extra = nn.Parameter(torch.randn(4, 4))
    opt = orthoptim.Dion3([*orthoptim.param_groups(model), {"params": [extra]}])
    assert opt.param_groups[-1]["param_names"] == [opt.param_name(extra)]
    first, second = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 8))
    opt = orthoptim.Muon([{"params": [first]}])
    opt.add_param_group({"params": [second], "param_names": ["second"]})
    assert opt.param_groups[0]["param_names"] == [opt.param_name(first)] and opt.param_name(second) == "second"
    first.grad, second.grad = torch.randn(4, 4), torch.randn(4, 8)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    third = nn.Parameter(torch.randn(8))
    opt = orthoptim.Muon([{"params": [first]}])
    opt.add_param_group({"params": [("third", third)], "algorithm": "adamw"})  # named as (name, tensor)
    assert opt.param_groups[0]["param_names"] == [opt.param_name(first)] and opt.param_name(third) == "third"
    third.grad = torch.randn(8)
    opt.step()
    opt.load_state_dict(opt.state_dict())


def test_a_classifier_head_without_a_vocabulary_goes_to_adamw():
    """ViT- and BERT-style classifiers (no embedding scored by the head): the model's last Linear,
    named like a classifier, goes to AdamW; hidden Linears and a last Linear with another name stay."""

    class ViTLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = nn.Conv2d(3, D, 4, 4)
            self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
            self.heads = nn.Sequential()
            self.heads.add_module("head", nn.Linear(D, 10))

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(D, D)
            self.project = nn.Linear(D, 4)

    vit = make(ViTLike)
    groups = orthoptim.param_groups(vit)
    assert group_of(groups, vit.heads.head.weight)["algorithm"] == "adamw"
    assert all("algorithm" not in group_of(groups, m.weight) for m in (vit.mlp[0], vit.mlp[2]))
    rows = {n: (kind, reason) for n, _, kind, reason in orthoptim.describe_assignment(vit)}
    assert rows["heads.head.weight"] == ("scalar", "output head (the model's last nn.Linear, named like a classifier)")
    regressor = make(Regressor)
    assert "algorithm" not in group_of(orthoptim.param_groups(regressor), regressor.project.weight)


def test_a_hidden_width_equal_to_an_embeddings_size_fools_neither_head_rule():
    """Learned positions of max_len = d_model made every width-d Linear a vocabulary "candidate": the
    classifier rule was never tried and fc stayed on Dion3. A vocabulary of d_model tokens scored
    through the tied embedding (no Linear head) made the MLP's down-projection the "output head"."""

    class TextClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(1000, D), nn.Embedding(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
            self.fc = nn.Linear(D, 2)

    class TiedCharLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(D, D)
            self.mlp_in, self.mlp_out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    classifier = make(TextClassifier)
    assert group_of(orthoptim.param_groups(classifier), classifier.fc.weight)["algorithm"] == "adamw"
    lm = make(TiedCharLM)
    groups = orthoptim.param_groups(lm)
    assert all("algorithm" not in group_of(groups, m.weight) for m in (lm.mlp_in, lm.mlp_out))


def test_recurrent_gate_weights_are_split_into_their_gates():
    """LSTM (4 gates) and GRU (3) stack their gates' rows in weight_ih/weight_hh, as attention stacks
    q, k, v: one block per gate. nn.RNN's one gate and an LSTM's projection weight_hr stay whole."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, D, num_layers=2, bidirectional=True, proj_size=4)
            self.gru, self.rnn, self.cell = nn.GRU(8, 12), nn.RNN(8, 6), nn.GRUCell(8, 10)

    model = make(Recurrent)
    groups = orthoptim.param_groups(model)
    for p, block, gates in [(model.lstm.weight_ih_l1_reverse, D, 4), (model.lstm.weight_hh_l0, D, 4),
                            (model.gru.weight_hh_l0, 12, 3), (model.cell.weight_ih, 10, 3)]:
        assert group_of(groups, p)["split_sizes"] == [block] * gates
    for p in (model.lstm.weight_hr_l0, model.rnn.weight_ih_l0, model.rnn.weight_hh_l0):
        assert "split_sizes" not in group_of(groups, p)
    opt = orthoptim.Dion3(groups)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = model.gru.weight_ih_l0.detach().clone()
    opt.step()
    assert not torch.equal(before, model.gru.weight_ih_l0)
    from torch.nn.utils.parametrizations import weight_norm

    class WeightNormed(nn.Module):  # the gate weights' directions under both weight norms
        def __init__(self) -> None:
            super().__init__()
            self.legacy = nn.utils.weight_norm(nn.LSTM(8, D), "weight_hh_l0")
            self.new = weight_norm(nn.GRU(8, 12), "weight_hh_l0")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # nn.utils.weight_norm is deprecated
        normed = make(WeightNormed)
    groups = orthoptim.param_groups(normed)
    assert group_of(groups, normed.legacy.weight_hh_l0_v)["split_sizes"] == [D] * 4
    assert group_of(groups, normed.new.parametrizations.weight_hh_l0.original1)["split_sizes"] == [12] * 3


def test_tables_kept_as_bare_parameters_go_to_adamw():
    """ViT's pos_embed (1, N, d) was a "batch of matrices" and a bare (max_len, d) position table a
    "matrix": both tables, which the matrix rules would orthogonalize. Bare matrices with other names,
    expert batches, one key head's (1, d, h) stack and a Bilinear's (1, in1, in2) weight stay matrices."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos_embed = nn.Parameter(torch.zeros(1, 17, D))
            self.register_tokens = nn.Parameter(torch.zeros(1, 4, D))
            self.relative_position_bias_table = nn.Parameter(torch.zeros(49, 4))
            self.pos_emb = nn.Parameter(torch.zeros(64, D))
            self.W_K = nn.Parameter(torch.randn(1, D, 4))  # one key head (multi-query attention): a map
            self.experts = nn.Parameter(torch.randn(4, D, 2 * D))
            self.w_in = nn.Parameter(torch.randn(2 * D, D))
            self.bilinear = nn.Bilinear(8, 8, 1)

    model = make(Model)
    groups = orthoptim.param_groups(model)
    for p in (model.pos_embed, model.register_tokens, model.relative_position_bias_table, model.pos_emb):
        assert group_of(groups, p)["algorithm"] == "adamw", tuple(p.shape)
    for p in (model.W_K, model.experts, model.w_in, model.bilinear.weight):
        assert "algorithm" not in group_of(groups, p), tuple(p.shape)


def test_an_embedding_bag_is_an_embedding():
    """nn.EmbeddingBag's table (a bag-of-words model's input layer) goes to AdamW as an embedding; as a
    plain module's weight it would be orthogonalized by the matrix rule."""
    model = nn.Sequential(nn.EmbeddingBag(100, D), nn.Linear(D, D))
    groups = orthoptim.param_groups(model)
    assert_partition(model, groups)
    assert group_of(groups, model[0].weight).get("algorithm") == "adamw", "the table took the matrix rule"
    assert "algorithm" not in group_of(groups, model[1].weight)
    rows = {n: (kind, reason) for n, _, kind, reason in orthoptim.describe_assignment(model)}
    assert rows["0.weight"] == ("scalar", "embedding of 0")


def test_multihead_attention_in_proj_is_split_into_q_k_v():
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(D, 4)
            self.ff = nn.Linear(D, D)

    model = make(Encoder)
    groups = orthoptim.param_groups(model)
    assert group_of(groups, model.attn.in_proj_weight)["split_sizes"] == [D, D, D]
    assert "split_sizes" not in group_of(groups, model.attn.out_proj.weight)
    opt = orthoptim.Muon(groups, lr=0.02)
    rows = {r[0]: r for r in parse_explain(orthoptim.explain(opt))}
    assert rows["attn.in_proj_weight"][3] == f"3 × [{D}, {D}]"
    kept = orthoptim.param_groups(model, overrides={"attn.in_proj_weight": {"split_sizes": [D, 2 * D]}})
    assert group_of(kept, model.attn.in_proj_weight)["split_sizes"] == [D, 2 * D]
    adamw = orthoptim.param_groups(model, overrides={"attn.in_proj_weight": {"algorithm": "adamw"}})
    assert "split_sizes" not in group_of(adamw, model.attn.in_proj_weight)


class Conv1D(nn.Module):
    """GPT-2's (Hugging Face) linear layer: the weight stored [in, out], used as x @ W + b."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


def test_weights_stored_in_out_are_read_transposed():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = Conv1D(3 * D, D)
            self.up = nn.ConvTranspose2d(D, 4, 2)
            self.conv = nn.Conv2d(4, D, 3)

    model = make(Model)
    groups = orthoptim.param_groups(model)
    assert group_of(groups, model.c_attn.weight)["transpose"] is True
    assert "flatten" not in group_of(groups, model.c_attn.weight)
    up = group_of(groups, model.up.weight)
    assert up["transpose"] is True and up["flatten"] is True
    assert "transpose" not in group_of(groups, model.conv.weight)
    opt = orthoptim.Muon(groups, lr=0.02)
    rows = {r[0]: r for r in parse_explain(orthoptim.explain(opt))}
    assert rows["c_attn.weight"][3] == f"[{3 * D}, {D}] (transposed)"  # rows are the 3·D outputs
    assert rows["up.weight"][3] == f"[{4 * 2 * 2}, {D}] (transposed)"
    adamw = orthoptim.param_groups(model, overrides={"c_attn.weight": {"algorithm": "adamw"}})
    assert "transpose" not in group_of(adamw, model.c_attn.weight)


def test_gpt2_fused_qkv_is_split_into_its_three_projections():
    """Hugging Face GPT-2 keeps q, k and v side by side in c_attn, a Conv1D [e, 3e] whose attention
    module records e as split_size: read transposed and cut into three [e, e] blocks, as
    nn.MultiheadAttention's in_proj_weight. Without split_size (another model's Conv1D) it stays whole."""
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.split_size = D
            self.c_attn, self.c_proj = Conv1D(3 * D, D), Conv1D(D, D)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.other = nn.Module()
            self.other.c_attn = Conv1D(3 * D, D)

    model = make(Model)
    groups = orthoptim.param_groups(model)
    fused = group_of(groups, model.attn.c_attn.weight)
    assert fused["transpose"] is True and fused["split_sizes"] == [D, D, D]
    assert "split_sizes" not in group_of(groups, model.attn.c_proj.weight)
    assert "split_sizes" not in group_of(groups, model.other.c_attn.weight)
    rows = {r[0]: r for r in parse_explain(orthoptim.explain(orthoptim.Muon(groups, lr=0.02)))}
    assert rows["attn.c_attn.weight"][3] == f"3 × [{D}, {D}] (transposed)"
    # as stored (for FSDP2) its outputs are columns, which split_sizes does not cut: left whole
    stored = orthoptim.param_groups(model, overrides={"*.c_*": {"transpose": False}})
    assert "split_sizes" not in group_of(stored, model.attn.c_attn.weight)


def test_a_lazy_module_not_yet_initialized_is_refused_by_name():
    """An uninitialized parameter reads as 1-D: it went to AdamW silently, and kept going there after
    the dry-run forward gave it its real shape."""
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"parameter 0\.weight of a lazy module .* forward pass"):
        orthoptim.param_groups(model)
    with pytest.raises(ValueError, match=r"parameter 0\.weight of a lazy module"):
        orthoptim.describe_assignment(model)
    model(torch.zeros(2, 8))
    assert group_of(orthoptim.param_groups(model), model[0].weight).get("algorithm") is None  # the matrix rule


def test_a_sparse_embedding_is_refused_when_the_groups_are_built():
    model = nn.Sequential(nn.Embedding(10, D, sparse=True), nn.Linear(D, D))
    with pytest.raises(ValueError, match=r"parameter 0\.weight .* sparse=True.*SparseAdam"):
        orthoptim.param_groups(model)
    model[0].weight.requires_grad_(False)  # left out here, for SparseAdam
    assert all(model[0].weight is not p for g in orthoptim.param_groups(model) for p in g["params"])
