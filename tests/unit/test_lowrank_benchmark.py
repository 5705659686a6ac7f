"""benchmarks.lowrank: the low-rank compressor's error feedback and factors, and a tiny run of every kind of
variant."""

from __future__ import annotations

import pytest
import torch

from benchmarks import lowrank


def test_what_the_factors_do_not_send_stays_in_the_buffer() -> None:
    torch.manual_seed(0)
    delta = {"w": torch.randn(48, 16), "b": torch.randn(16)}
    sender = lowrank.LowRank(rank=3, fmt="int8")
    sent, nbytes = sender.send(delta)
    # Rank 3 of a random 48 x 16 matrix: the buffer holds exactly the rest, the vector goes whole.
    assert torch.allclose(sent["w"] + sender.buffers["w"], delta["w"], atol=1e-6)
    assert torch.equal(sent["b"], delta["b"]) and "b" not in sender.buffers
    assert torch.linalg.matrix_rank(sent["w"]) == 3
    assert nbytes == 48 * 3 + 3 * 16 + 2 * 2 * 3 + 4 * 16  # int8 factors, their float16 scales, the vector
    # The next round sends from beta x the rest plus the new delta.
    rest = sender.buffers["w"].clone()
    sent2, _ = sender.send({"w": delta["w"], "b": delta["b"]})
    assert torch.allclose(sent2["w"] + sender.buffers["w"], lowrank.BETA * rest + delta["w"], atol=1e-5)


@pytest.mark.parametrize("power", [0, 1, 2])
def test_a_matrix_of_the_rank_sent_arrives_whole(power: int) -> None:
    torch.manual_seed(1)
    low = torch.randn(40, 2) @ torch.randn(2, 24)
    sender = lowrank.LowRank(rank=2, fmt="fp16", power=power)
    sent, nbytes = sender.send({"w": low})
    assert torch.allclose(sent["w"], low, rtol=0, atol=2e-2 * low.abs().max())
    assert sender.buffers["w"].norm() < 1e-2 * low.norm()
    assert nbytes == 2 * 2 * (40 + 24)


def test_every_kind_of_variant_runs_and_reports_its_gap_and_bytes(capsys: pytest.CaptureFixture) -> None:
    variants = "averaging,codec,codec:64,codec:fit,lowrank:2:int8,lowrank:2:fp16:power,lowrank:2:int8:power2"
    argv = ["--model", "gpt-tiny", "--rounds", "2", "--inner-steps", "2", "--sequence-length", "16", "--json"]
    result = lowrank.main([*argv, "--variants", variants])
    assert set(result["variants"]) == set(variants.split(","))
    runs = result["variants"]
    assert runs["averaging"]["gap_vs_averaging"] == 0.0 and runs["averaging"]["x_fewer_than_fp32_gradients"] == 2.0
    assert (runs["codec"]["topk"], runs["codec:64"]["topk"]) == (143, 64)  # local-SGD rounds' default, and given
    assert runs["codec:64"]["bytes_per_worker_round"] < runs["codec"]["bytes_per_worker_round"]
    # The mode's own factors (--rank fit, int4) fit a smaller top-k's bytes than the top-k the variant reports.
    assert runs["codec:fit"]["bytes_per_worker_round"] < runs["codec"]["bytes_per_worker_round"]
    # fp16 factors at rank 2 cost twice int8's, less the scales.
    assert runs["lowrank:2:fp16:power"]["bytes_per_worker_round"] > runs["lowrank:2:int8"]["bytes_per_worker_round"]
    for r in runs.values():
        assert len(r["held_out_by_round"]) == 2 and r["held_out_by_round"][-1] == r["held_out_loss"]
        assert r["held_out_loss"] < 10.0  # gpt-tiny starts near ln(vocab) and trains
    assert '"variants"' in capsys.readouterr().out


def test_an_unknown_variant_is_refused_before_anything_trains() -> None:
    with pytest.raises(SystemExit, match="unknown variant 'lowrank:2'"):
        lowrank.main(["--model", "gpt-tiny", "--rounds", "1", "--inner-steps", "1", "--variants", "codec,lowrank:2"])


def test_encode_times_every_way_of_factoring_at_the_same_bytes() -> None:
    result = lowrank.main(["--encode", "--model", "gpt-tiny", "--rounds", "2", "--json"])
    encode = result["encode"]
    assert set(encode) == {"power", "auto", "topk"} and result["fit_ranks"] and result["factored_matrices"] > 0
    assert encode["power"]["payload_bytes"] == encode["auto"]["payload_bytes"]  # another way, the same payload size
    assert all(w["first_round_s"] > 0 and w["later_rounds_s"] > 0 for w in encode.values())
