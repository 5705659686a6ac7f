"""The outer optimizer: each rule is the step it claims to be (torch's own SGD where one exists), as data."""

import json

import pytest
import torch

from gradwire.optim.outer import UpdateRule, outer_step


def test_signsgd_is_demo_step_with_decoupled_weight_decay():
    p = torch.tensor([1.0, -2.0, 0.5])
    g = torch.tensor([0.3, -0.1, 0.0])
    outer_step([p], [g], UpdateRule(optimizer="signsgd", weight_decay=0.5), lr=0.1)
    torch.testing.assert_close(p, torch.tensor([1.0, -2.0, 0.5]) * (1 - 0.05) - 0.1 * torch.tensor([1.0, -1.0, 0.0]))


def test_sgd_momentum_replays():
    p, m = torch.zeros(2), []
    rule = UpdateRule(optimizer="sgd", momentum=0.5)
    outer_step([p], [torch.ones(2)], rule, 1.0, m)
    outer_step([p], [torch.ones(2)], rule, 1.0, m)
    torch.testing.assert_close(p, torch.full((2,), -2.5))  # -1, then -(0.5 + 1)


@pytest.mark.parametrize(("optimizer", "nesterov"), [("sgd", False), ("nesterov", True)])
def test_momentum_rules_match_torch_sgd_on_pseudo_gradients(optimizer, nesterov):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    ours = [t.clone() for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    torch_sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=nesterov)
    rule, buffers = UpdateRule(optimizer=optimizer, momentum=0.9), []
    for _ in range(5):
        deltas = [torch.randn(t.shape, generator=gen) for t in start]  # a round's pseudo-gradients
        outer_step(ours, deltas, rule, 0.7, buffers)
        for p, d in zip(ref, deltas):
            p.grad = d.clone()
        torch_sgd.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)


def test_outer_sgd_with_lr_one_lands_on_the_mean_model():
    # DiLoCo's identity: pseudo-gradients replica - working_i, averaged, stepped with lr 1 = average of models.
    replica = torch.tensor([1.0, 2.0])
    workers = [torch.tensor([0.0, 3.0]), torch.tensor([1.0, 1.0])]
    mean_delta = torch.stack([replica - w for w in workers]).mean(0)
    outer_step([replica], [mean_delta], UpdateRule(optimizer="sgd"), 1.0)
    torch.testing.assert_close(replica, torch.stack(workers).mean(0))


def test_update_rule_validates_and_round_trips():
    for rule in (
        UpdateRule(optimizer="sgd", momentum=0.9, weight_decay=0.01),
        UpdateRule(optimizer="nesterov", momentum=0.9),
    ):
        assert UpdateRule.from_json(rule.to_json()) == rule
    assert UpdateRule(optimizer="nesterov", momentum=0.9).replayable and not UpdateRule(optimizer="adamw").replayable
    with pytest.raises(ValueError, match="outer-optimizer"):
        UpdateRule(optimizer="lion")
    with pytest.raises(ValueError, match="momentum"):
        UpdateRule(optimizer="signsgd", momentum=0.9)
    with pytest.raises(ValueError, match="nesterov needs --momentum"):
        UpdateRule(optimizer="nesterov")
    with pytest.raises(ValueError, match="momentum"):
        UpdateRule(optimizer="sgd", momentum=float("nan"))
    for bad in ('{"optimizer": "sgd", "foo": 1}', "null", "[1]", '{"betas": 3}', '{"momentum": "x"}', "{not json"):
        with pytest.raises(ValueError):
            UpdateRule.from_json(bad)


def test_a_downlink_that_would_factor_what_the_workers_send_as_top_k_keeps_their_codec():
    """--rank fit: a 32-row matrix gets no rank-1 term from its top-k's bytes, but does from 4x them."""
    import dataclasses

    from gradwire.compression import CodecConfig
    from gradwire.coordinator.outer import ReplayOuter
    from gradwire.optim.outer import UpdateRule

    workers = CodecConfig(topk=143, indices="elias-fano", values="lut", bins=4, rank_fits_topk=True)
    downlink = dataclasses.replace(workers, topk=4 * 143)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 512), torch.nn.Linear(512, 512))
    outer = ReplayOuter(model, UpdateRule(optimizer="sgd"), workers, downlink)
    assert outer.downlink_codec is outer.codec
    wide = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 1024))  # cut alike: its own
    outer = ReplayOuter(wide, UpdateRule(optimizer="sgd"), workers, downlink)
    assert outer.downlink_codec.config == downlink


def _loop_sign_step(params, grads, lr, weight_decay):
    """The sign step a tensor at a time, as the reference."""
    for p, g in zip(params, grads):
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        p.add_(torch.sign(g.float()).to(p.dtype), alpha=-lr)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_sign_step_in_batches_is_the_bits_of_a_tensor_at_a_time(weight_decay, monkeypatch):
    from gradwire.optim import outer

    monkeypatch.setattr(outer, "BATCH_ELEMENTS", 100)  # several batches, one tensor larger than a batch
    monkeypatch.setattr(outer, "ALONE_ON", frozenset())  # batched as on a GPU
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (150,), (2, 2), (40,), (1,)]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    start = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]
    grads = [torch.randn(s, generator=gen) * (torch.rand(s, generator=gen) > 0.2) for s in shapes]  # zeros too
    assert [len(b) for b in outer._batches(start, grads, [1.0] * len(start))] == [2, 1, 2, 1]
    ours, ref = [t.clone() for t in start], [t.clone() for t in start]
    for lr in (0.01, 1e-3):
        outer_step(ours, grads, UpdateRule(optimizer="signsgd", weight_decay=weight_decay), lr)
        _loop_sign_step(ref, grads, lr, weight_decay)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_sign_step_dispatches_a_few_operations_whatever_the_number_of_tensors(monkeypatch):
    from gradwire.optim import outer

    monkeypatch.setattr(outer, "ALONE_ON", frozenset())  # batched as on a GPU
    params = [torch.zeros(16) for _ in range(60)]
    grads = [torch.randn(16) for _ in range(60)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outer_step(params, grads, UpdateRule(optimizer="signsgd", weight_decay=0.1), 0.01)
    top = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    # one sign, one decay and one add for the batch; each gradient's .to (already float32 there) copies nothing
    assert sorted(n for n in top if n != "aten::to") == [
        "aten::_foreach_add_",
        "aten::_foreach_mul_",
        "aten::_foreach_sign",
    ]


def test_on_a_cpu_the_sign_step_goes_a_tensor_at_a_time():
    from gradwire.optim import outer

    params, grads = [torch.zeros(16) for _ in range(3)], [torch.randn(16) for _ in range(3)]
    assert [len(b) for b in outer._batches(params, grads, [1.0] * 3)] == [1, 1, 1]


@pytest.mark.parametrize("optimizer,momentum", [("signsgd", 0.0), ("sgd", 0.9), ("nesterov", 0.9)])
def test_each_tensor_steps_at_its_learning_rate_factor(optimizer, momentum, monkeypatch):
    """``scales`` (``UpdateRule.lr_scales``): each tensor steps as the plain step at lr times its factor, its
    decay too; a factor of 1 is the step without factors to the bit; batches never mix factors."""
    from gradwire.optim import outer

    monkeypatch.setattr(outer, "ALONE_ON", frozenset())  # batched as on a GPU
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(s, generator=gen) for s in [(6, 4), (5,), (3, 3), (2,)]]
    grads = [torch.randn(t.shape, generator=gen) for t in start]
    factors = [2.0, 1.0, 0.5, 1.0]
    assert [len(b) for b in outer._batches(start, grads, factors)] == [1, 1, 1, 1]
    assert [len(b) for b in outer._batches(start, grads, [1.0] * 4)] == [4]
    rule = UpdateRule(optimizer=optimizer, momentum=momentum, weight_decay=0.1)
    ours, buffers = [t.clone() for t in start], []
    for lr in (0.01, 0.003):
        outer_step(ours, grads, rule, lr, buffers, factors)
    for i, f in enumerate(factors):
        alone, own = [start[i].clone()], []
        for lr in (0.01, 0.003):
            outer_step(alone, [grads[i]], rule, lr * f, own)
        assert torch.equal(ours[i], alone[0]), i
    with pytest.raises(ValueError, match="factors for"):
        outer_step(ours, grads, rule, 0.01, [], factors[:2])


def test_an_update_rules_learning_rate_factors_round_trip_and_are_checked():
    rule = UpdateRule(optimizer="signsgd", lr_scales=(("tok_emb.weight", 2.0),))
    assert UpdateRule.from_json(rule.to_json()) == rule
    assert rule.lr_scale("tok_emb.weight") == 2.0 and rule.lr_scale("norm.weight") == 1.0
    rule.check_names({"tok_emb.weight", "norm.weight"})
    with pytest.raises(ValueError, match="does not have"):
        rule.check_names({"norm.weight"})
    bad = [
        ([["a", 2.0]] * 2, "twice"),
        ([["a", 0.0]], "factor"),
        ([["a", float("inf")]], "factor"),
        ([["a", True]], "factor"),
        ([["a", "2"]], "factor"),
        ([["", 2.0]], "name"),
        ([[7, 2.0]], "name"),
        ([["a", 2.0, 3.0]], "pairs"),
        ([["p%d" % i, 2.0] for i in range(65)], "at most"),
        ({"a": 2.0}, "list"),
    ]
    for scales, why in bad:
        text = json.dumps({"optimizer": "signsgd", "lr_scales": scales})
        with pytest.raises(ValueError, match=why):
            UpdateRule.from_json(text)
    with pytest.raises(ValueError, match="replayed"):
        UpdateRule(optimizer="adamw", lr_scales=(("a", 2.0),))
