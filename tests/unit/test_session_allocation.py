"""A worker allocates a replica's parameters as a push delivers them, not when the push names the model."""

from __future__ import annotations

import json

import pytest
import torch

from gradwire.models import build_from_spec, model_spec
from gradwire.protocol import ProtocolError
from gradwire.statestream import StateHeader
from gradwire.worker.session import Session

# 4 layers of d_model 2048: about 235M parameters, 0.94 GB of float32 that a 300-byte header names.
LARGE = {**model_spec("gpt-tiny"), "config": {**model_spec("gpt-tiny")["config"], "n_layer": 4, "d_model": 2048}}
LARGE["config"]["d_ff"] = 8192
RULE = '{"optimizer": "sgd"}'


def allocated(session: Session) -> int:
    return sum(p.numel() * p.element_size() for p in session.replica.params.values() if not p.is_meta)


def test_a_header_naming_a_large_model_allocates_none_of_its_parameters() -> None:
    session = Session(StateHeader("big", 0, json.dumps(LARGE), RULE), torch.device("cpu"))
    params = session.replica.params
    assert sum(p.numel() for p in params.values()) > 200_000_000 and allocated(session) == 0
    # What a tensor brings is what is allocated: here the largest of a block's.
    name = max(params, key=lambda n: params[n].numel() if n != "tok_emb.weight" else 0)
    t = torch.randn(session.replica.shapes[name])
    session.load("parameters", name, t)
    assert allocated(session) == t.numel() * 4
    assert torch.equal(session.replica.params[name], t) and not session.replica.params[name].is_meta
    with pytest.raises(ProtocolError, match="missing parameter"):
        session.loaded()


def test_a_pushed_state_lands_in_a_model_allocated_a_parameter_at_a_time() -> None:
    spec = model_spec("gpt-tiny")
    source = build_from_spec(spec, seed=3)
    session = Session(StateHeader("tiny", 7, json.dumps(spec), RULE), torch.device("cpu"))
    for name, p in source.named_parameters():
        session.load("parameters", name, p.detach())
    session.loaded()
    model = session.replica.model
    assert session.replica.version == 7 and allocated(session) == sum(p.numel() * 4 for p in source.parameters())
    for (name, p), (other, q) in zip(model.named_parameters(), source.named_parameters()):
        assert name == other and torch.equal(p, q) and p.device.type == "cpu" and p.requires_grad
    # The tied embedding (named once, as tok_emb.weight) stays tied, and the model computes what the source does.
    assert model.lm_head.weight is model.tok_emb.weight is session.replica.params["tok_emb.weight"]
    tokens = torch.randint(0, 8192, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model(tokens)[0], source(tokens)[0])


def test_a_resumed_gossip_workers_own_model_comes_with_its_push_checked_as_it_arrives() -> None:
    """``ModelState.gossip_model``: each tensor is checked as it arrives (a parameter's name and shape), the
    whole set once the push is in, and the worker's own model is then that state, not the replica."""
    spec = model_spec("gpt-tiny")
    source, own = build_from_spec(spec, seed=3), build_from_spec(spec, seed=4)
    session = Session(StateHeader("tiny", 0, json.dumps(spec), RULE), torch.device("cpu"))
    with pytest.raises(ProtocolError, match="no parameter of this model"):
        session.load("gossip_model", "tok_emb.weight", torch.zeros(3))
    with pytest.raises(ProtocolError, match="no parameter of this model"):
        session.load("gossip_model", "nope", torch.zeros(3))
    for name, p in source.named_parameters():
        session.load("parameters", name, p.detach())
        session.load("gossip_model", name, dict(own.named_parameters())[name].detach())
    session.loaded()
    assert session.own_model_restored
    for (name, p), q in zip(own.named_parameters(), session.own_model().parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(session.replica.params["tok_emb.weight"], dict(source.named_parameters())["tok_emb.weight"])
    partial = Session(StateHeader("tiny", 0, json.dumps(spec), RULE), torch.device("cpu"))
    for name, p in source.named_parameters():
        partial.load("parameters", name, p.detach())
    partial.load("gossip_model", "tok_emb.weight", source.tok_emb.weight.detach())
    with pytest.raises(ProtocolError, match="every parameter"):
        partial.loaded()
