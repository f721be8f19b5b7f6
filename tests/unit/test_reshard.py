"""pytest tests/unit/test_reshard.py — the pure checkpoint math (zerorun/zero/checkpoint/reshard.py): piece
keys, re-partitioning plans between any two layouts, model checks and tag retention."""

from __future__ import annotations

import itertools

import pytest

from zerorun.zero.checkpoint.reshard import (MASTER, Piece, Uncovered, bad_tag, first_mismatch, index_pieces,
                                  micro_steps_after_load, parse_piece_key, piece_key, plan_reads, state_family,
                                  step_tag, tags_to_delete, whole_key)
from zerorun.zero.unit.layout import ParamSpec, Segment, UnitLayout, pack_buckets

SPECS = [ParamSpec("embed.weight", 255), ParamSpec("inner.weight", 105), ParamSpec("inner.bias", 7),
         ParamSpec("outer.weight", 105), ParamSpec("norm.bias", 15)]


def saved_files(specs, world: int, bucket: int, alignment: int = 8) -> dict[str, list[str]]:
    """The keys each rank would write for ``specs`` packed into ``bucket``-element units."""
    files = {}
    for rank in range(world):
        keys = []
        for unit in pack_buckets(specs, bucket):
            for seg in UnitLayout(unit, world, alignment).segments(rank):
                keys.append(piece_key(MASTER, seg.name, seg.param_offset, seg.length))
        files[f"rank{rank}.safetensors"] = keys
    return files


def values_of(specs):
    """A distinct number for every element of every parameter: (name, element)."""
    return {s.name: [(s.name, i) for i in range(s.numel)] for s in specs}


@pytest.mark.parametrize("saved_world,load_world,saved_bucket,load_bucket",
                         list(itertools.product((1, 2, 3), (1, 2, 3, 5), (100, 400), (64, 1000))))
def test_every_layout_reads_back_every_element_exactly_once(saved_world, load_world, saved_bucket, load_bucket):
    files = saved_files(SPECS, saved_world, saved_bucket)
    index = index_pieces(files, MASTER)
    whole = values_of(SPECS)
    stored = {}  # (file, key) -> the saved tensor
    for file, keys in files.items():
        for key in keys:
            _, name, start, length = parse_piece_key(key)
            stored[(file, key)] = whole[name][start : start + length]
    for rank in range(load_world):
        for unit in pack_buckets(SPECS, load_bucket):
            layout = UnitLayout(unit, load_world, 8)
            segments = layout.segments(rank)
            chunk = [None] * layout.chunk_numel
            for read in plan_reads(segments, index):
                piece = stored[(read.file, read.key)]
                chunk[read.target_offset : read.target_offset + read.length] = piece[read.offset : read.offset + read.length]
            for seg in segments:
                assert chunk[seg.shard_offset : seg.shard_offset + seg.length] == whole[seg.name][seg.param_offset : seg.param_offset + seg.length]


def test_a_gap_names_the_parameter_and_range():
    index = {"w": [Piece("w", 0, 10, "a", "k1"), Piece("w", 12, 8, "b", "k2")]}
    with pytest.raises(Uncovered) as gap:
        plan_reads([Segment("w", 5, 0, 10)], index)
    assert (gap.value.name, gap.value.start, gap.value.end) == ("w", 10, 15)
    with pytest.raises(Uncovered, match="missing"):
        plan_reads([Segment("missing", 0, 0, 1)], index)


def test_keys_round_trip_and_whole_keys_are_not_pieces():
    key = piece_key(state_family("exp_avg"), "blocks.0.attn.qkv.weight", 128, 64)
    assert key == "state.exp_avg/blocks.0.attn.qkv.weight/128+64"
    assert parse_piece_key(key) == ("state.exp_avg", "blocks.0.attn.qkv.weight", 128, 64)
    assert parse_piece_key(whole_key("buffer", "norm.running_mean")) is None
    assert index_pieces({"f": [key, piece_key(MASTER, "x", 0, 3)]}, MASTER) == {"x": [Piece("x", 0, 3, "f", "master/x/0+3")]}


def test_first_mismatch_names_the_first_parameter_in_model_order():
    saved = {"a": [2, 3], "b": [4], "c": [5]}
    assert first_mismatch(saved, {"a": [2, 3], "b": [4], "c": [5]}) is None
    assert "'b' has shape [5] in the model but [4]" in first_mismatch(saved, {"a": [2, 3], "b": [5], "c": [6]})
    assert "'z' of the model is not in the checkpoint" in first_mismatch(saved, {"z": [1], "a": [2, 3]})
    assert "checkpoint has buffer 'c'" in first_mismatch(saved, {"a": [2, 3], "b": [4]}, what="buffer")


def test_tags_and_retention():
    assert step_tag(40) == "global_step40"
    assert bad_tag("global_step40") is None and bad_tag("best-v1.2") is None
    for bad in ("", "..", "a/b", "x.partial", "latest", "t.replaced-1"):
        assert bad_tag(bad), bad
    tags = ["global_step10", "global_step2", "global_step30", "best", "global_step20"]
    assert tags_to_delete(tags, 2, "global_step30") == ["global_step2", "global_step10"]
    assert tags_to_delete(tags, 1, "global_step20") == ["global_step2", "global_step10"]  # just saved stays
    assert tags_to_delete(["best"], 1, "best") == []


def test_accumulation_position_after_load():
    assert micro_steps_after_load(40, 4, 10, 4) == 40
    assert micro_steps_after_load(40, 4, 10, 2) == 20
