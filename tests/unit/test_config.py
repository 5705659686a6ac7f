"""TrainConfig: each mode's defaults fill what was not given, explicit values win, bad values name the flag;
every setting's help, section and choices live in its field's metadata, and a field is all a flag needs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from gradwire.coordinator import cli as coordinator_cli
from gradwire.coordinator.cli import load_train
from gradwire.coordinator.config import AUTO_FIELDS, ROUND_POLICY, SECTIONS, TrainConfig, mode_defaults, setting


def test_gradient_mode_keeps_demo_defaults_in_fewer_bytes() -> None:
    c = TrainConfig()
    assert (c.inner_steps, c.local_sgd) == (1, False)
    assert (c.outer_optimizer, c.learning_rate, c.momentum, c.feedback_beta) == ("signsgd", 1e-3, 0.0, 0.999)
    # DeMo's top-32 in 12-bit indices and 8-bit values costs 640 bits a chunk; the default 464: top-36 in
    # Elias-Fano indices and 4-bit values
    codec = c.codec_config()
    assert (c.bins, c.index_coding, c.topk) == (codec.bins, codec.indices, codec.topk) == (16, "elias-fano", 36)
    assert TrainConfig(index_coding="packed12").topk == 29


def test_gradient_mode_averages_each_coefficient_over_its_senders_and_the_others_over_all() -> None:
    assert TrainConfig().aggregate == "kept-mean"
    assert TrainConfig(inner_steps=30).aggregate == TrainConfig(no_compression=True).aggregate == "mean"
    assert TrainConfig(topology="ring", inner_steps=30).aggregate == "mean"
    assert TrainConfig(aggregate="median").aggregate == "median"  # given: kept
    assert TrainConfig().aggregation_rule().mode == "kept-mean"


def test_gradient_modes_sign_step_moves_the_token_embedding_at_twice_the_rate() -> None:
    gradient = TrainConfig()
    assert gradient.embedding_lr_scale == 2.0
    rule = gradient.update_rule(["tok_emb.weight"])
    assert rule.lr_scales == (("tok_emb.weight", 2.0),) and gradient.update_rule().lr_scales == ()
    # every other mode and outer optimizer: the one rate, and no factors in the rule
    for other in (
        TrainConfig(inner_steps=30),
        TrainConfig(outer_optimizer="sgd"),
        TrainConfig(outer_optimizer="adamw"),
        TrainConfig(inner_steps=30, topology="ring"),
    ):
        assert other.embedding_lr_scale == 1.0 and other.update_rule(["tok_emb.weight"]).lr_scales == ()
    given = TrainConfig(inner_steps=30, embedding_lr_scale=3.0).update_rule(["tok_emb.weight"])
    assert given.lr_scales == (("tok_emb.weight", 3.0),)


def test_local_sgd_rounds_inner_adamw_moves_the_token_embedding_at_twice_the_rate() -> None:
    local = TrainConfig(inner_steps=30)
    assert local.inner_embedding_lr_scale == 2.0
    assert local.inner_optimizer_config(["tok_emb.weight"]).lr_scales == (("tok_emb.weight", 2.0),)
    assert local.inner_optimizer_config().lr_scales == ()
    assert TrainConfig(inner_steps=30, no_compression=True).inner_embedding_lr_scale == 2.0
    # gradient mode takes no inner steps; muon, demuon, sgd and gossip rounds keep the one rate
    for other in (
        TrainConfig(),
        TrainConfig(inner_steps=30, inner_optimizer="muon"),
        TrainConfig(inner_steps=30, inner_optimizer="demuon"),
        TrainConfig(inner_steps=30, inner_optimizer="sgd"),
        TrainConfig(inner_steps=30, topology="ring"),
    ):
        assert (
            other.inner_embedding_lr_scale == 1.0 and other.inner_optimizer_config(["tok_emb.weight"]).lr_scales == ()
        )
    given = TrainConfig(inner_steps=30, inner_optimizer="muon", inner_embedding_lr_scale=3.0)
    assert given.inner_optimizer_config(["tok_emb.weight"]).lr_scales == (("tok_emb.weight", 3.0),)


def test_local_sgd_defaults_follow_sparseloco_and_diloco() -> None:
    compressed = TrainConfig(inner_steps=30)
    defaults = mode_defaults(inner_steps=30, no_compression=False, outer_optimizer=None, inner_optimizer="adamw")
    assert compressed.local_sgd and compressed.outer_optimizer == "sgd"
    assert {k: getattr(compressed, k) for k in defaults} == defaults
    assert compressed.bins == 4 and compressed.feedback_beta == 0.95 and compressed.codec_config().bins == 4
    assert (compressed.topk, TrainConfig().topk, TrainConfig(inner_steps=30, topk=16).topk) == (82, 36, 16)
    # The 82 is the bytes fitted int4 factors fill, 0.62x the mode's top-k: with --rank 0 the top-k travels.
    assert (compressed.rank, compressed.factor_bits, TrainConfig(inner_steps=30, rank=0).topk) == ("fit", 4, 143)
    # Past H 30 the top-k grows with H: the same uplink bytes per trained token (12-bit indices' counts).
    twelve = [TrainConfig(inner_steps=h, index_coding="packed12").topk for h in (2, 15, 30, 60, 120, 2000)]
    assert twelve == [90, 90, 90, 180, 360, 4096]
    assert TrainConfig(inner_steps=120, target_chunk=32, index_coding="packed12").topk == 90
    dense = TrainConfig(inner_steps=30, no_compression=True)
    assert (dense.outer_optimizer, dense.learning_rate, dense.momentum) == ("nesterov", 0.7, 0.9)
    assert TrainConfig(inner_steps=30, inner_optimizer="muon").inner_momentum == 0.95
    demuon = TrainConfig(inner_steps=30, inner_optimizer="demuon", msgn="svd").inner_optimizer_config()
    assert (demuon.momentum, demuon.msgn) == (0.8, "svd")  # the seed's momentum
    with pytest.raises(ValueError, match="--msgn applies to --inner-optimizer demuon only"):
        TrainConfig(inner_steps=30, msgn="svd")


def test_the_chunk_follows_the_mode_and_topk_keeps_the_density_at_any_chunk() -> None:
    gradient, local = TrainConfig(), TrainConfig(inner_steps=30)
    assert (gradient.target_chunk, gradient.topk, gradient.codec_config().density) == (64, 36, 36 / 4096)
    assert (local.target_chunk, local.topk, local.index_coding) == (64, 82, "elias-fano")
    # A chunk given alone keeps the mode's density (29 of 64x64 in 12-bit indices in gradient mode) ...
    assert [TrainConfig(target_chunk=c, index_coding="packed12").topk for c in (64, 32, 16, 8)] == [29, 7, 2, 1]
    assert [TrainConfig(inner_steps=30, target_chunk=c, index_coding="packed12").topk for c in (64, 32)] == [90, 22]
    # ... and an explicit topk is taken as given.
    assert (TrainConfig(topk=8).target_chunk, TrainConfig(topk=8).topk) == (64, 8)
    assert (TrainConfig(topk=4, target_chunk=16).target_chunk, TrainConfig(topk=4, target_chunk=16).topk) == (16, 4)
    with pytest.raises(ValueError, match="--target-chunk"):
        TrainConfig(target_chunk=0)


def test_elias_fano_indices_keep_as_many_coefficients_as_fit_the_bytes_of_the_mode_default() -> None:
    assert TrainConfig(inner_steps=30, index_coding="elias-fano").topk == 143  # 90 in 12-bit indices
    assert TrainConfig(index_coding="elias-fano").topk == 36  # gradient mode: 29 at 4-bit values
    assert TrainConfig(inner_steps=30, index_coding="elias-fano", topk=100).topk == 100  # given: kept
    # The default in every mode
    local = TrainConfig(inner_steps=30)
    assert local.index_coding == local.codec_config().indices == "elias-fano" and local.codec_config().topk == 82
    assert (TrainConfig().index_coding, TrainConfig().codec_config().indices) == ("elias-fano", "elias-fano")
    assert TrainConfig(inner_steps=30, index_coding="packed12").topk == 90


def test_explicit_values_win_over_the_mode_defaults() -> None:
    c = TrainConfig(inner_steps=30, outer_optimizer="nesterov", learning_rate=0.3, bins=16, feedback_beta=0.9)
    assert (c.outer_optimizer, c.learning_rate, c.momentum, c.bins, c.feedback_beta) == ("nesterov", 0.3, 0.9, 16, 0.9)
    c = TrainConfig(inner_steps=30, outer_optimizer="nesterov", momentum=0.5)
    assert (c.learning_rate, c.momentum) == (0.7, 0.5)


def test_schedules_are_evaluated_per_round_and_per_inner_step() -> None:
    c = TrainConfig(
        steps=10,
        learning_rate=1.0,
        lr_schedule="linear",
        warmup_steps=2,
        inner_steps=4,
        inner_learning_rate=1.0,
        inner_warmup_steps=4,
    )
    assert [c.lr_at(s) for s in (0, 1)] == [0.5, 1.0] and c.lr_at(10) == 0.0
    assert c.inner_lrs(0) == (0.25, 0.5, 0.75, 1.0)  # warmup counts inner steps, across rounds
    assert c.inner_lrs(1) == (1.0,) * 4


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"inner_steps": 0}, "--inner-steps"),
        ({"inner_learning_rate": 0.0}, "--inner-learning-rate"),
        ({"clip_grad_norm": -1.0}, "--clip-grad-norm"),
        ({"inner_optimizer": "lion"}, "--inner-optimizer"),
        ({"inner_optimizer": "sgd", "inner_nesterov": True}, "--inner-nesterov"),
        ({"outer_optimizer": "nesterov", "momentum": 0.0}, "--momentum"),
        ({"lr_schedule": "exp"}, "--lr-schedule"),
        ({"inner_lr_schedule": "cosine", "inner_min_lr_ratio": 2.0}, "--inner-min-lr-ratio"),
        ({"values": "float"}, "--values"),
        ({"index_coding": "varint"}, "--index-coding"),
        ({"bins": 1}, "--bins"),
        ({"log_every": -1.0}, "--log-every"),
        ({"stream_buckets": 65}, "--stream-buckets"),
        ({"fingerprint_every": 0}, "--fingerprint-every"),
        ({"stream_buckets": 4, "inner_steps": 30}, "--stream-buckets"),
        ({"overlap_update": "soon"}, "--overlap-update"),
        (
            {"overlap": True, "inner_steps": 30, "overlap_update": "eager", "outer_optimizer": "adamw"},
            "--overlap-update",
        ),
        ({"overlap": True, "inner_steps": 30, "overlap_update": "eager", "fragments": 2}, "--overlap-update"),
        ({"embedding_lr_scale": 0.0}, "--embedding-lr-scale"),
        ({"embedding_lr_scale": math.inf}, "--embedding-lr-scale"),
        ({"embedding_lr_scale": 2.0, "outer_optimizer": "adamw"}, "--embedding-lr-scale"),
        ({"inner_steps": 30, "inner_embedding_lr_scale": 0.0}, "--inner-embedding-lr-scale"),
        ({"inner_steps": 30, "inner_embedding_lr_scale": 1001.0}, "--inner-embedding-lr-scale"),
        ({"inner_embedding_lr_scale": 2.0}, "--inner-embedding-lr-scale"),  # gradient mode: no inner steps
    ],
)
def test_bad_values_name_the_flag(changes: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        TrainConfig(**changes)


def test_the_command_line_reaches_the_mode_defaults() -> None:
    config, _ = load_train(["train", "--local", "2", "--inner-steps", "30"])
    assert (config.inner_steps, config.outer_optimizer, config.learning_rate, config.bins) == (30, "sgd", 1.0, 4)
    config, _ = load_train(
        [
            "train",
            "--local",
            "2",
            "--learning-rate",
            "0.25",
            "--bins",
            "16",
            "--values",
            "sign",
            "--inner-optimizer",
            "muon",
            "--inner-momentum",
            "0.8",
            "--index-coding",
            "elias-fano",
        ]
    )
    assert (config.learning_rate, config.bins, config.values, config.inner_momentum) == (0.25, 16, "sign", 0.8)
    assert config.codec_config().indices == "elias-fano"
    # "auto" says so explicitly (compose passes it when a setting is left unset).
    config, _ = load_train(
        [
            "train",
            "--local",
            "2",
            "--inner-steps",
            "30",
            "--learning-rate",
            "auto",
            "--outer-optimizer",
            "auto",
            "--bins",
            "auto",
        ]
    )
    assert (config.learning_rate, config.outer_optimizer, config.bins) == (1.0, "sgd", 4)


@pytest.mark.parametrize("seconds", [-0.5, math.inf, math.nan])
def test_log_every_must_be_a_finite_number_of_seconds(seconds: float) -> None:
    with pytest.raises(ValueError, match="--log-every must be >= 0"):
        TrainConfig(log_every=seconds)


def test_log_every_defaults_to_thirty_seconds_and_zero_means_only_at_the_end() -> None:
    assert TrainConfig().log_every == 30.0 and TrainConfig(log_every=0).log_every == 0
    config, _ = load_train(["train", "--local", "1", "--log-every", "5"])
    assert config.log_every == 5.0


def test_every_setting_carries_its_help_section_and_choices_in_its_metadata() -> None:
    fields = dataclasses.fields(TrainConfig)
    for field in fields:
        meta = field.metadata
        assert isinstance(meta.get("help"), str) and meta["help"].strip(), field.name
        assert meta.get("section") in SECTIONS, field.name
        choices = meta.get("choices")
        assert choices is None or (isinstance(choices, tuple) and all(isinstance(c, str) for c in choices))
        if choices is not None and field.default is not None:
            assert field.default in choices, field.name
    # The fields are ordered by section, the sections in the order of SECTIONS (and so of --help).
    order = [list(SECTIONS).index(f.metadata["section"]) for f in fields]
    assert order == sorted(order)
    assert set(AUTO_FIELDS) <= {f.name for f in fields if f.default is None}
    # The CLI keeps no help or choices of its own.
    assert not hasattr(coordinator_cli, "HELP") and not hasattr(coordinator_cli, "CHOICES")


def test_settings_name_a_known_section() -> None:
    with pytest.raises(ValueError, match="unknown settings section"):
        setting(1, help="h", section="misc")


def test_a_new_field_is_all_a_flag_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    @dataclasses.dataclass(kw_only=True)
    class Extended(TrainConfig):
        straggler_policy: str = setting(
            "wait", help="what to do with stragglers", section=ROUND_POLICY, choices=("wait", "drop")
        )
        patience: float = setting(1.5, help="seconds of patience", section=ROUND_POLICY)

    monkeypatch.setattr(coordinator_cli, "TrainConfig", Extended)
    config, _ = load_train(["train", "--local", "1", "--straggler-policy", "drop", "--patience", "2"])
    assert (config.straggler_policy, config.patience) == ("drop", 2.0)
    path = tmp_path / "run.yaml"
    path.write_text("local: 1\nstraggler_policy: drop\npatience: 3\n")
    config, args = load_train(["train", "--config", str(path)])
    assert (config.straggler_policy, config.patience) == ("drop", 3.0)
    assert {"straggler_policy", "patience"} <= set(args.config_keys)
    path.write_text("local: 1\nstraggler_policy: hurry\n")
    with pytest.raises(SystemExit):
        load_train(["train", "--config", str(path)])
    assert "'straggler_policy': must be one of wait, drop" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag in --help
    train = coordinator_cli.subcommand_parser(coordinator_cli.build_parser(), "train")
    (group,) = [g for g in train._action_groups if g.title == ROUND_POLICY]
    assert {"--straggler-policy", "--patience"} <= {o for a in group._group_actions for o in a.option_strings}
    assert "seconds of patience (default: 1.5)" in train.format_help()


def test_gossip_rounds_take_their_defaults_and_refuse_what_centralized_rounds_alone_do() -> None:
    ring = TrainConfig(topology="ring", inner_steps=3)
    assert ring.gossip and ring.takes_inner_steps and not TrainConfig().gossip
    # Elias-Fano indices: top-1024 of 4096 in the bytes of top-512 with 12-bit indices.
    assert (ring.gossip_gamma, ring.topk, ring.bins, ring.spot_check_every) == (0.5, 1024, 16, 0)
    assert ring.index_coding == "elias-fano" and ring.codec_config().indices == "elias-fano"
    assert TrainConfig(topology="ring", index_coding="packed12").topk == 512
    assert TrainConfig(topology="complete", no_compression=True).gossip_gamma == 1.0
    demuon = TrainConfig(topology="complete", inner_optimizer="demuon")
    assert (demuon.gossip_gamma, demuon.topk) == (0.7, 2048)  # orthogonalised steps: less compressible
    assert TrainConfig(topology="ring", inner_optimizer="demuon", index_coding="packed12").topk == 1024
    assert TrainConfig(topology="ring", inner_optimizer="demuon", topk=512).topk == 512  # a given top-k stands
    assert TrainConfig(topology="ring").takes_inner_steps  # one inner step a round at H 1
    assert TrainConfig(topology="ring", resume_from="runs/x").resume_from  # gossip runs resume
    for flags, named in [
        (dict(overlap=True), "--overlap"),
        (dict(inner_steps=4, fragments=2), "--fragments"),
        (dict(gossip_gamma=1.5), "--gossip-gamma"),
        (dict(topology="torus"), "--topology"),
    ]:
        with pytest.raises(ValueError, match=named):
            TrainConfig(**{"topology": "ring", **flags})


def test_centralized_local_sgd_rounds_send_factors_unless_a_top_k_is_asked_for() -> None:
    # Each matrix at the rank that fits its top-k's bytes, whatever H (the top-k grows with H past 30).
    assert [TrainConfig(inner_steps=h).rank for h in (2, 30, 120)] == ["fit"] * 3
    codec = TrainConfig(inner_steps=30).codec_config()
    assert (codec.rank, codec.rank_fits_topk, codec.topk, codec.factor_bits) == (0, True, 82, 4)
    # Gradient mode, gossip rounds and uncompressed rounds keep the top-k (or send it all).
    assert [TrainConfig().rank, TrainConfig(inner_steps=30, topology="ring").rank] == [0, 0]
    assert TrainConfig(inner_steps=30, no_compression=True).rank == 0
    # A top-k setting asks for the top-k; an explicit rank wins.
    for given in (dict(topk=90), dict(target_chunk=32), dict(use_dct=False), dict(index_coding="packed12")):
        assert TrainConfig(inner_steps=30, **given).rank == 0, given
    assert TrainConfig(inner_steps=30, topk=90, rank=4).rank == 4
    assert TrainConfig(inner_steps=30, rank="6").rank == 6  # typed or from a file
    with pytest.raises(ValueError, match="--rank must be a non-negative integer or 'fit'"):
        TrainConfig(inner_steps=30, rank="most")


def test_rank_reaches_the_codec_and_the_downlink_takes_four_times_it() -> None:
    config = TrainConfig(inner_steps=30, rank=7)
    assert (config.codec_config().rank, config.downlink_codec_config().rank) == (7, 28)
    fit = TrainConfig(inner_steps=30).downlink_codec_config()  # fits the downlink's 4x top-k
    assert (fit.rank, fit.rank_fits_topk, fit.topk, fit.factor_bits) == (0, True, 328, 4)
    assert TrainConfig().codec_config().rank == 0 and TrainConfig().downlink_codec_config().rank == 0
    with pytest.raises(ValueError, match="--rank"):
        TrainConfig(rank=-1)
    with pytest.raises(ValueError, match="--no-compression"):
        TrainConfig(rank=4, no_compression=True)
    config, _ = load_train(["train", "--local", "1", "--rank", "5"])
    assert config.codec_config().rank == 5
    config, _ = load_train(["train", "--local", "1", "--inner-steps", "30", "--rank", "auto"])
    assert config.codec_config().rank_fits_topk
    config, _ = load_train(["train", "--local", "1", "--rank", "fit"])
    assert config.rank == "fit" and config.codec_config().rank_fits_topk
    config, _ = load_train(["train", "--local", "1", "--inner-steps", "30", "--factor-bits", "8"])
    assert config.codec_config().factor_bits == 8
