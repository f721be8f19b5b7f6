"""pytest tests/unit/test_lookup_rows.py — the arithmetic of Note [lookup gradients]
(zerorun/zero/lookup_gradients.py): rows summed per token, their owners among the chunks of the
flat table, and their addition into a chunk, against the dense lookup gradient autograd computes;
and of Note [lookup rows first] (zerorun/zero/lookup_rows.py): the pieces of the looked-up rows
each chunk sends, laid end to end, are those rows of the table."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch import nn

from zerorun.zero.lookup_gradients import add_rows, chunk_rows, looked_up_plainly, owned_by, rows_by_token
from zerorun.zero.lookup_rows import piece_sizes, rows_piece


def dense_gradient(ids: torch.Tensor, grad_output: torch.Tensor, rows: int, padding_idx: int | None) -> torch.Tensor:
    weight = torch.zeros(rows, grad_output.shape[-1], dtype=torch.float64, requires_grad=True)
    F.embedding(ids, weight, padding_idx).backward(grad_output.double())
    return weight.grad.reshape(-1)


def test_rows_added_into_every_chunk_rebuild_the_dense_gradient():
    generator = torch.Generator().manual_seed(0)
    rows, width = 13, 5  # 65 elements: chunks of 17 (world 4, padded to 68) cut rows apart
    for world, padding_idx in ((4, None), (3, 2), (2, 0), (1, None)):
        ids = torch.randint(0, rows, (3, 7), generator=generator)
        ids[0, :3] = 2  # a repeated token (and the padding token in one case)
        grad_output = torch.randn(3, 7, width, generator=generator)
        distinct, summed = rows_by_token(ids, grad_output, padding_idx)
        assert distinct.unique().numel() == distinct.numel()
        assert padding_idx is None or padding_idx not in distinct.tolist()
        chunk_numel = -(-rows * width // world)
        rebuilt = []
        for rank in range(world):
            chunk = torch.zeros(chunk_numel, dtype=torch.float64)
            mine = owned_by(distinct, rank, chunk_numel, width, rows)
            add_rows(chunk, rank, width, distinct[mine], summed[mine])
            rebuilt.append(chunk)
        expected = dense_gradient(ids, grad_output, rows, padding_idx)
        assert torch.allclose(torch.cat(rebuilt)[: rows * width], expected, atol=1e-6), (world, padding_idx)
        assert torch.all(torch.cat(rebuilt)[rows * width :] == 0)


def test_a_row_cut_by_a_chunk_boundary_belongs_to_both_chunks():
    assert chunk_rows(0, 17, 5, 13) == (0, 4)  # elements 0-16: rows 0-3 (row 3 is elements 15-19)
    assert chunk_rows(1, 17, 5, 13) == (3, 7)
    assert chunk_rows(3, 17, 5, 13) == (10, 13)  # elements 51-64 and padding
    assert chunk_rows(4, 17, 5, 13) == (0, 0)
    assert owned_by(torch.tensor([3, 4, 7]), 1, 17, 5, 13).tolist() == [True, True, False]


class ScaledEmbedding(nn.Embedding):
    """As BART's scaled word embedding: the rows times a factor."""

    def forward(self, ids):
        return super().forward(ids) * 8.0


def test_only_a_plain_lookup_is_recomputed():
    assert looked_up_plainly(nn.Embedding(10, 4))
    assert looked_up_plainly(nn.Embedding(10, 4, padding_idx=0))
    assert not looked_up_plainly(ScaledEmbedding(10, 4))  # its output is not F.embedding's
    wrapped = nn.Embedding(10, 4)
    wrapped.forward = lambda ids: nn.Embedding.forward(wrapped, ids) + 1.0  # a wrapper set on the instance
    assert not looked_up_plainly(wrapped)
    assert not looked_up_plainly(nn.Embedding(10, 4, max_norm=1.0))
    assert not looked_up_plainly(nn.Embedding(10, 4, scale_grad_by_freq=True))
    assert not looked_up_plainly(nn.Embedding(10, 4, sparse=True))
    assert not looked_up_plainly(nn.Linear(4, 10))


def test_the_chunks_pieces_end_to_end_are_the_looked_up_rows():
    generator = torch.Generator().manual_seed(1)
    for rows, width, world in ((13, 5, 4), (13, 5, 1), (40, 6, 3), (9, 8, 5), (7, 16, 8)):
        # chunks of 17, 80, 72, 15 (shorter than two rows) and 14 elements (shorter than a row;
        # world 8 pads past the table's end)
        table = torch.randn(rows * width, generator=generator)
        chunk_numel = -(-rows * width // world)
        padded = torch.cat([table, torch.full((chunk_numel * world - rows * width,), float("nan"))])
        for count in (1, 2, rows // 2, rows):
            union = torch.randperm(rows, generator=generator)[:count].sort().values
            sizes = piece_sizes(union, world, chunk_numel, width, rows)
            pieces = [rows_piece(padded[r * chunk_numel : (r + 1) * chunk_numel], r, union, width, rows)
                      for r in range(world)]
            assert [p.numel() for p in pieces] == sizes, (rows, width, world, count)
            assert sum(sizes) == count * width
            assert torch.equal(torch.cat(pieces).view(count, width), table.view(rows, width)[union]), (rows, width, world, count)
    assert rows_piece(torch.arange(10.0), 0, torch.tensor([], dtype=torch.int64), 5, 2).numel() == 0
