"""pytest tests/unit/test_sharding.py — the pure shard math, with no process group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.zero.unit.layout import ParamSpec, UnitLayout, pack_buckets, round_up

sizes = st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=6)


def specs_of(numels, prefix="p"):
    return tuple(ParamSpec(f"{prefix}{i}", n) for i, n in enumerate(numels))


def test_odd_sizes_are_padded_so_every_rank_gets_an_equal_chunk():
    layout = UnitLayout(specs_of([7, 15, 17]), world_size=3)
    assert layout.numel == 39
    assert layout.chunk_numel == 13 and layout.padded_numel == 39
    layout2 = UnitLayout(specs_of([7, 15, 17]), world_size=2, alignment=4)
    assert layout2.chunk_numel == 20 and layout2.padded_numel == 40
    assert layout2.chunk_range(1) == (20, 40)


def test_segments_name_the_pieces_each_rank_holds():
    layout = UnitLayout(specs_of([7, 15, 17]), world_size=2)  # 39 -> chunks of 20
    assert [(s.name, s.param_offset, s.shard_offset, s.length) for s in layout.segments(0)] == [
        ("p0", 0, 0, 7), ("p1", 0, 7, 13),
    ]
    assert [(s.name, s.param_offset, s.shard_offset, s.length) for s in layout.segments(1, shard_base=5)] == [
        ("p1", 13, 5, 2), ("p2", 0, 7, 17),
    ]


@settings(max_examples=200, deadline=None)
@given(numels=sizes, world=st.integers(1, 5), alignment=st.sampled_from([1, 2, 8]))
def test_chunks_tile_the_unit_and_segments_cover_every_element_once(numels, world, alignment):
    layout = UnitLayout(specs_of(numels), world, alignment)
    assert layout.padded_numel >= layout.numel
    assert layout.padded_numel - layout.numel < max(world * alignment, 1) or layout.numel == 0
    assert layout.chunk_numel % alignment == 0
    ends = [layout.chunk_range(r) for r in range(world)]
    assert ends[0][0] == 0 and ends[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    covered = {spec.name: [0] * spec.numel for spec in layout.params}
    for rank in range(world):
        for seg in layout.segments(rank):
            assert 0 <= seg.shard_offset and seg.shard_offset + seg.length <= layout.chunk_numel
            for i in range(seg.param_offset, seg.param_offset + seg.length):
                covered[seg.name][i] += 1
    assert all(count == 1 for counts in covered.values() for count in counts)


@settings(max_examples=100, deadline=None)
@given(units=st.lists(sizes, min_size=1, max_size=4), world=st.integers(1, 4))
def test_shards_reassemble_into_the_original_parameters(units, world):
    """Fill parameters with known values, cut them into every rank's shard, put them back."""
    layouts = tuple(UnitLayout(specs_of(n, prefix=f"u{u}."), world) for u, n in enumerate(units))
    specs = [spec for layout in layouts for spec in layout.params]
    values = {spec.name: [hash((spec.name, i)) % 997 for i in range(spec.numel)] for spec in specs}
    whole = {spec.name: [None] * spec.numel for spec in specs}
    for layout in layouts:
        flat = [v for spec in layout.params for v in values[spec.name]]
        flat += [0] * (layout.padded_numel - len(flat))
        for rank in range(world):
            start, end = layout.chunk_range(rank)
            chunk = flat[start:end]
            for seg in layout.segments(rank):
                piece = chunk[seg.shard_offset : seg.shard_offset + seg.length]
                whole[seg.name][seg.param_offset : seg.param_offset + seg.length] = piece
    assert whole == values


def test_pack_buckets_keeps_order_and_never_splits_a_parameter():
    buckets = pack_buckets(specs_of([5, 5, 5, 20, 1]), bucket_numel=10)
    assert [[s.numel for s in b] for b in buckets] == [[5, 5], [5], [20], [1]]
    assert [s.name for b in buckets for s in b] == ["p0", "p1", "p2", "p3", "p4"]


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        UnitLayout(specs_of([3]), world_size=0)
    with pytest.raises(ValueError):
        UnitLayout(specs_of([3]), world_size=2).chunk_range(2)
    assert round_up(13, 4) == 16 and round_up(16, 4) == 16
