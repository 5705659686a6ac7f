"""Splitting a model into pipeline stages (``worker.pipeline``), in one process: the stages, run one after
another, are the whole model; each allocates only its own tensors, under the whole model's names."""

from __future__ import annotations

import pytest
import torch

from gradwire.models import build_from_spec, model_spec
from gradwire.models.registry import lm_loss
from gradwire.worker import pipeline


def _gpt_spec(layers: int = 4) -> dict:
    spec = model_spec("gpt-tiny")
    return {**spec, "config": {**spec["config"], "n_layer": layers}}


def _llama_spec(tied: bool) -> dict:
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }
    return {"arch": "hf", "config": config}


def _stages(spec: dict, count: int) -> list[tuple[pipeline.Stage, torch.nn.Module]]:
    """Every stage of ``spec``'s model (seed 0), each built the way a rank builds it, holding the whole
    model's values for its tensors."""
    whole = build_from_spec(spec, seed=0)
    out = []
    for index in range(count):
        with torch.device("meta"):
            meta = build_from_spec(spec)
        stage = pipeline.plan_stage(meta, index, count)
        model = pipeline.materialize(pipeline.stage_model(meta, stage), stage, torch.device("cpu"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(whole.get_parameter(name))
        out.append((stage, model))
    return out


def test_blocks_split_contiguously_and_evenly_later_stages_taking_the_extra():
    assert pipeline.stage_blocks(8, 2) == [range(0, 4), range(4, 8)]
    assert pipeline.stage_blocks(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert pipeline.stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="at least 3 blocks"):
        pipeline.stage_blocks(2, 3)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_gpt_stages_chained_are_the_whole_model(count: int):
    spec = _gpt_spec(4)
    whole = build_from_spec(spec, seed=0)
    tokens = torch.randint(0, 8192, (3, 17), generator=torch.Generator().manual_seed(0))
    x = tokens[:, :-1]
    for stage, model in _stages(spec, count):
        x = pipeline.StageModule(model, stage)(x)
    expected = lm_loss(whole, tokens)
    loss = torch.nn.functional.cross_entropy(x.flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)


def test_each_gpt_stage_holds_its_blocks_under_the_whole_models_names_and_the_tied_embedding_is_the_firsts():
    spec = _gpt_spec(4)
    names = [n for n, _ in build_from_spec(spec).named_parameters()]
    stages = _stages(spec, 2)
    (first, a), (last, b) = stages
    a_names, b_names = [n for n, _ in a.named_parameters()], [n for n, _ in b.named_parameters()]
    assert a_names[0] == "tok_emb.weight" and {n.split(".")[1] for n in a_names[1:]} == {"0", "1"}
    assert "tok_emb.weight" in b_names and "norm.weight" in b_names and "norm.weight" not in a_names
    assert b.lm_head.weight is b.tok_emb.weight  # still tied after materialize
    owned = pipeline.owned_names(a, first) + pipeline.owned_names(b, last)
    assert sorted(owned) == sorted(names)  # each tensor encoded by exactly one stage
    assert sum(p.numel() for p in b.parameters()) < sum(p.numel() for p in build_from_spec(spec).parameters())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_stages_chained_are_the_whole_model(tied: bool):
    spec = _llama_spec(tied)
    whole = build_from_spec(spec, seed=0)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    x = tokens[:, :-1]
    stages = _stages(spec, 3)
    for stage, model in stages:
        x = pipeline.StageModule(model, stage)(x)
    loss = torch.nn.functional.cross_entropy(x.flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(loss, lm_loss(whole, tokens), atol=1e-5, rtol=0)
    owned = [n for stage, model in stages for n in pipeline.owned_names(model, stage)]
    assert sorted(owned) == sorted(n for n, _ in whole.named_parameters())


def test_a_model_of_another_family_is_refused_naming_those_that_split():
    spec = model_spec("opt-125m")
    with torch.device("meta"):
        model = build_from_spec(spec)
    with pytest.raises(ValueError, match="LlamaForCausalLM.*--node-mode fsdp"):
        pipeline.plan_stage(model, 0, 2)
