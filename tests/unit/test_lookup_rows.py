"""pytest tests/unit/test_lookup_rows.py — the arithmetic of Note [lookup gradients]
(zerorun/zero/lookup_gradients.py): rows summed per token, their owners among the chunks of the
flat table, and their addition into a chunk, against the dense lookup gradient autograd computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerorun.zero.lookup_gradients import add_rows, chunk_rows, owned_by, rows_by_token


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
