"""The inner optimizer: exact state round trips, Muon's parameter rule and update, input checks, config."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

# Set before transformers is imported anywhere: without them a hub look-up retries for ~50 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from torch import nn

from gradwire.models import GPT, build_model, lm_loss
from gradwire.optim import INNER_OPTIMIZERS, InnerOptimizer, InnerOptimizerConfig, muon_parameters

VOCAB = 8192  # gpt-tiny's
CONFIGS = {
    "adamw": InnerOptimizerConfig(name="adamw", weight_decay=0.1),
    "sgd": InnerOptimizerConfig(name="sgd", momentum=0.9, nesterov=True, weight_decay=0.01),
    "muon": InnerOptimizerConfig(name="muon", momentum=0.95, weight_decay=0.1),
    "demuon": InnerOptimizerConfig(name="demuon", momentum=0.8, msgn="svd", weight_decay=0.01),
}
LR = {"adamw": 1e-2, "sgd": 0.5, "muon": 1e-2, "demuon": 0.1}


@pytest.fixture(scope="module")
def tiny() -> GPT:
    model = build_model("gpt-tiny", seed=0)
    assert isinstance(model, GPT)
    return model


def batch(step: int) -> torch.Tensor:
    """(4, 33) random token ids, a pure function of the step."""
    return torch.randint(0, VOCAB, (4, 33), generator=torch.Generator().manual_seed(1000 + step))


def train(model: nn.Module, opt: InnerOptimizer, steps: range, lr: float) -> list[float]:
    losses = []
    for step in steps:
        loss = lm_loss(model, batch(step))
        loss.backward()
        opt.step(lr)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", INNER_OPTIMIZERS)
def test_state_round_trip_continues_bit_identically(tiny: GPT, name: str) -> None:
    config, lr = CONFIGS[name], LR[name]
    straight = copy.deepcopy(tiny)
    train(straight, InnerOptimizer(straight, config), range(5), lr)

    first = copy.deepcopy(tiny)
    opt = InnerOptimizer(first, config)
    train(first, opt, range(3), lr)
    saved = opt.state_tensors()
    # What crosses the network: plain named CPU tensors (safetensors-ready), nothing else.
    assert saved and all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in saved.values())

    resumed = copy.deepcopy(tiny)  # a fresh process: same parameters, new optimizer
    resumed.load_state_dict(first.state_dict())
    fresh = InnerOptimizer(resumed, config)
    fresh.load_state_tensors(saved)
    assert fresh.state_tensors().keys() == saved.keys()
    train(resumed, fresh, range(3, 5), lr)

    for (n, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), n


def test_state_keys_name_parameter_and_state(tiny: GPT) -> None:
    names = [n for n, _ in tiny.named_parameters()]
    keys = {}
    for name in INNER_OPTIMIZERS:
        model = copy.deepcopy(tiny)
        opt = InnerOptimizer(model, CONFIGS[name])
        assert opt.state_tensors() == {}  # no gradient yet, no state
        train(model, opt, range(1), LR[name])
        keys[name] = opt.state_tensors()
    assert list(keys["adamw"]) == [f"{n}/{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")]
    assert list(keys["sgd"]) == [f"{n}/momentum_buffer" for n in names]
    hidden = set(muon_parameters(tiny))
    assert {k for k in keys["muon"] if k.endswith("/momentum_buffer")} == {f"{n}/momentum_buffer" for n in hidden}
    assert {k.rpartition("/")[0] for k in keys["muon"] if k.endswith("/exp_avg")} == set(names) - hidden
    assert keys["adamw"]["tok_emb.weight/step"].shape == () and keys["adamw"]["tok_emb.weight/step"].item() == 1


def test_plain_sgd_keeps_no_state(tiny: GPT) -> None:
    model = copy.deepcopy(tiny)
    opt = InnerOptimizer(model, InnerOptimizerConfig(name="sgd"))
    train(model, opt, range(2), 0.1)
    assert opt.state_tensors() == {}
    with pytest.raises(ValueError, match="norm.weight/momentum_buffer"):
        opt.load_state_tensors({"norm.weight/momentum_buffer": torch.zeros(64)})


def test_a_few_steps_of_each_optimizer_lower_the_loss(tiny: GPT) -> None:
    fixed = batch(0)
    for name in INNER_OPTIMIZERS:
        model = copy.deepcopy(tiny)
        opt = InnerOptimizer(model, CONFIGS[name])
        losses = []
        for _ in range(6):
            loss = lm_loss(model, fixed)
            loss.backward()
            opt.step(LR[name])
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 1.0, (name, losses)


def test_muon_takes_exactly_the_hidden_matrices_of_the_gpt(tiny: GPT) -> None:
    expected = [
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.gate", "mlp.up", "mlp.down")
    ]
    assert muon_parameters(tiny) == expected
    # Not the embedding its head is tied to (one tensor, named tok_emb.weight), not the norms.
    assert tiny.lm_head.weight is tiny.tok_emb.weight
    assert "tok_emb.weight" not in expected and not any("norm" in n for n in expected)


class _Untied(nn.Module):
    """An HF-shaped toy: embeddings, a hidden matrix with a bias, an untied head behind get_output_embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.pos = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_muon_rule_leaves_embeddings_head_and_biases_to_adamw() -> None:
    assert muon_parameters(_Untied()) == ["hidden.weight"]


@pytest.mark.slow  # importing transformers takes seconds
@pytest.mark.parametrize("tied", [False, True])
def test_muon_rule_on_a_tiny_hf_model(tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = "model.layers.0"
    assert muon_parameters(model) == [f"{layer}.self_attn.{m}_proj.weight" for m in "qkvo"] + [
        f"{layer}.mlp.{m}_proj.weight" for m in ("gate", "up", "down")
    ]


def test_muon_update_is_approximately_orthogonal() -> None:
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    assert muon_parameters(model) == ["0.weight"]
    p = model[0].weight
    before = p.detach().clone()
    # A full-rank gradient whose singular values spread 1..4: orthogonalization should flatten them.
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    p.grad = u @ torch.diag(torch.linspace(1.0, 4.0, 32)) @ v.T
    opt = InnerOptimizer(model, InnerOptimizerConfig(name="muon", momentum=0.95))
    lr = 1e-3
    opt.step(lr)
    # match_rms_adamw: the orthogonalized update is scaled by 0.2 * sqrt(max(A, B)).
    update = (before - p.detach()).double() / (lr * 0.2 * 32**0.5)
    s = torch.linalg.svdvals(update)  # (32,)
    assert s.min() > 0.5 * s.mean() and s.max() < 1.5 * s.mean(), s
    assert 0.6 < s.mean() < 1.4, s.mean()  # near 1: an orthogonal matrix times the expected scale
    # It points downhill along the gradient's own singular directions.
    assert torch.sum(update * p.grad.double()) > 0


def _muon_pair(shapes: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch, native_bf16: bool):
    """Our Muon and torch's on identical parameters and gradients, with the CPU's bfloat16 as given."""
    from gradwire import hardware
    from gradwire.optim.muon import Muon

    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda: native_bf16)
    gen = torch.Generator().manual_seed(7)
    ours = [nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    settings = dict(lr=1e-2, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    return ours, theirs, Muon(ours, **settings), torch.optim.Muon(theirs, **settings)


def _step_both(ours, theirs, opt_ours, opt_theirs, steps: int) -> None:
    gen = torch.Generator().manual_seed(8)
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt_ours.step()
        opt_theirs.step()


def test_muon_on_a_cpu_that_emulates_bf16_runs_newton_schulz_in_float32(monkeypatch) -> None:
    from gradwire.optim.muon import newton_schulz_dtype

    shapes = [(24, 40), (40, 24)]  # wide and tall
    ours, theirs, opt_ours, opt_theirs = _muon_pair(shapes, monkeypatch, native_bf16=False)
    assert newton_schulz_dtype(torch.device("cpu")) == torch.float32
    start = [p.detach().clone() for p in theirs]
    _step_both(ours, theirs, opt_ours, opt_theirs, steps=3)
    for p, q, p0 in zip(ours, theirs, start):
        # torch's bfloat16 iteration and our float32 one differ by bfloat16's rounding, not in kind...
        assert (p - q).norm() < 0.03 * (q - p0).norm()
        # ...but they do differ: this really is another precision.
        assert not torch.equal(p, q)
    # The same state under the same keys: a checkpoint moves between the two.
    for p, q in zip(ours, theirs):
        assert opt_ours.state[p].keys() == opt_theirs.state[q].keys() == {"momentum_buffer"}
        assert torch.equal(opt_ours.state[p]["momentum_buffer"], opt_theirs.state[q]["momentum_buffer"])


def test_muon_where_bf16_is_native_is_torchs_own_step(monkeypatch) -> None:
    ours, theirs, opt_ours, opt_theirs = _muon_pair([(24, 40), (40, 24)], monkeypatch, native_bf16=True)
    _step_both(ours, theirs, opt_ours, opt_theirs, steps=3)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_load_rejects_bad_state_and_changes_nothing(tiny: GPT) -> None:
    model = copy.deepcopy(tiny)
    opt = InnerOptimizer(model, CONFIGS["adamw"])
    train(model, opt, range(2), LR["adamw"])
    good = opt.state_tensors()
    w = "blocks.0.attn.qkv.weight"

    nan = good[f"{w}/exp_avg"].clone()
    nan[0, 0] = float("nan")
    cases = [
        ({"nope.weight/exp_avg": torch.zeros(1)}, "nope.weight"),
        ({"exp_avg": torch.zeros(1)}, "'exp_avg'"),
        ({f"{w}/": torch.zeros(1)}, f"{w}/"),
        ({f"{w}/momentum_buffer": torch.zeros(192, 64)}, f"{w}/momentum_buffer"),
        ({f"{w}/exp_avg": torch.zeros(64, 192)}, f"{w}/exp_avg"),
        ({f"{w}/exp_avg": nan}, f"{w}/exp_avg"),
        ({f"{w}/exp_avg_sq": -torch.ones(192, 64)}, f"{w}/exp_avg_sq"),
        ({f"{w}/exp_avg": torch.zeros(192, 64, dtype=torch.int64)}, f"{w}/exp_avg"),
        ({f"{w}/step": torch.tensor(float("inf"))}, f"{w}/step"),
        ({f"{w}/step": torch.tensor(1.5)}, f"{w}/step"),
        ({f"{w}/step": None}, f"{w}/step"),  # a parameter with only part of its state
        ({f"{w}/exp_avg": [0.0]}, f"{w}/exp_avg"),
    ]
    # Every valid entry changed (zeros are valid state): had any been applied, the state would differ.
    zeros = {k: v if k.endswith("/step") else torch.zeros_like(v) for k, v in good.items()}
    for change, named in cases:
        state = dict(zeros)
        for key, value in change.items():
            if value is None:
                del state[key]
            else:
                state.pop(key, None)
                state[key] = value  # last: checked after every valid entry
        with pytest.raises(ValueError, match=re.escape(named)):
            opt.load_state_tensors(state)
        after = opt.state_tensors()
        assert after.keys() == good.keys() and all(torch.equal(after[k], good[k]) for k in good), change


def test_load_copies_and_empty_state_clears(tiny: GPT) -> None:
    model = copy.deepcopy(tiny)
    opt = InnerOptimizer(model, CONFIGS["muon"])
    train(model, opt, range(1), LR["muon"])
    state = opt.state_tensors()
    kept = {k: v.clone() for k, v in state.items()}
    opt.load_state_tensors(state)
    for v in state.values():
        v.add_(1.0)  # the caller's tensors are its own: the optimizer must not share them
    after = opt.state_tensors()
    assert after.keys() == kept.keys() and all(torch.equal(after[k], v) for k, v in kept.items())
    opt.load_state_tensors({})
    assert opt.state_tensors() == {}


def test_step_refuses_a_bad_learning_rate(tiny: GPT) -> None:
    opt = InnerOptimizer(copy.deepcopy(tiny), CONFIGS["adamw"])
    for lr in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="learning rate"):
            opt.step(lr)


BAD_CONFIGS = [
    ({"name": "lion"}, "--inner-optimizer"),
    ({"weight_decay": -0.1}, "--inner-weight-decay"),
    ({"weight_decay": float("nan")}, "--inner-weight-decay"),
    ({"betas": (0.9,)}, "--inner-betas"),
    ({"betas": (0.9, 1.0)}, "--inner-betas"),
    ({"betas": (-0.1, 0.95)}, "--inner-betas"),
    ({"eps": 0.0}, "--inner-eps"),
    ({"momentum": 0.9}, "--inner-momentum"),  # adamw's momentum is beta1
    ({"name": "sgd", "momentum": 1.0}, "--inner-momentum"),
    ({"name": "sgd", "momentum": -0.5}, "--inner-momentum"),
    ({"name": "muon"}, "--inner-momentum"),  # explicit: no hidden default
    ({"name": "muon", "momentum": 1.0}, "--inner-momentum"),
    ({"name": "sgd", "nesterov": True}, "--inner-nesterov"),  # without momentum
    ({"name": "muon", "momentum": 0.95, "nesterov": True}, "--inner-nesterov"),
    ({"nesterov": 1}, "--inner-nesterov"),
    ({"name": "muon", "momentum": 0.95, "ns_steps": 0}, "--inner-ns-steps"),
    ({"name": "muon", "momentum": 0.95, "ns_steps": 100}, "--inner-ns-steps"),
    ({"name": "demuon", "momentum": 1.0}, "--inner-momentum"),
    ({"name": "demuon", "momentum": 0.8, "msgn": "polar"}, "--msgn"),
    ({"name": "muon", "momentum": 0.95, "msgn": "svd"}, "--msgn"),  # demuon's setting only
    ({"lr_scales": (("tok_emb.weight", 0.0),)}, "factor"),
    ({"lr_scales": (("tok_emb.weight", 2.0),) * 2}, "twice"),
    ({"lr_scales": (("", 2.0),)}, "name"),
    ({"lr_scales": tuple((f"p{i}", 2.0) for i in range(65))}, "at most"),
]


@pytest.mark.parametrize(("kwargs", "flag"), BAD_CONFIGS)
def test_config_errors_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        InnerOptimizerConfig(**kwargs)


def test_config_round_trips_as_json_and_refuses_unknown_keys() -> None:
    scaled = InnerOptimizerConfig(lr_scales=(("tok_emb.weight", 2),))
    assert scaled.lr_scales == (("tok_emb.weight", 2.0),)  # (str, float) pairs, whatever number was given
    for config in (*CONFIGS.values(), scaled):
        wire = json.loads(json.dumps(config.to_dict()))
        back = InnerOptimizerConfig.from_dict(wire)
        assert back == config and isinstance(back.betas, tuple)
    with pytest.raises(ValueError, match="lr"):
        InnerOptimizerConfig.from_dict({"name": "adamw", "lr": 0.1})
    with pytest.raises(ValueError, match="--inner-optimizer"):
        InnerOptimizerConfig.from_dict({"name": "adam"})


@pytest.mark.parametrize("name", INNER_OPTIMIZERS)
def test_a_scaled_parameter_steps_as_alone_at_its_factor_of_the_rate(tiny: GPT, name: str) -> None:
    """``lr_scales``: the embedding steps (and decays) bit for bit as an optimizer at 3 lr would step it,
    every other parameter as at lr; the state of the split param groups round-trips mid-way."""
    config, lr = CONFIGS[name], LR[name]
    scaled_config = dataclasses.replace(config, lr_scales=(("tok_emb.weight", 3.0), ("not.in.this.stage", 2.0)))
    models = {key: copy.deepcopy(tiny) for key in ("scaled", "at_lr", "at_3lr")}
    opts = {
        "scaled": InnerOptimizer(models["scaled"], scaled_config),
        "at_lr": InnerOptimizer(models["at_lr"], config),
        "at_3lr": InnerOptimizer(models["at_3lr"], config),
    }
    rates = {"scaled": lr, "at_lr": lr, "at_3lr": 3 * lr}
    generator = torch.Generator().manual_seed(5)
    for step in range(4):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in tiny.named_parameters()}
        if step == 2:  # the scaled optimizer's state through a fresh one, as a resumed worker's
            saved = opts["scaled"].state_tensors()
            opts["scaled"] = InnerOptimizer(models["scaled"], scaled_config)
            opts["scaled"].load_state_tensors(saved)
        for key, model in models.items():
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            opts[key].step(rates[key])
            opts[key].zero_grad()
    scaled, at_lr, at_3lr = (dict(models[k].named_parameters()) for k in ("scaled", "at_lr", "at_3lr"))
    assert not torch.equal(at_lr["tok_emb.weight"], at_3lr["tok_emb.weight"])
    for n, p in scaled.items():
        assert torch.equal(p, (at_3lr if n == "tok_emb.weight" else at_lr)[n]), n
