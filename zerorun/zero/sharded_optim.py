"""The optimizer over this rank's fp32 master chunks, and the step pipeline around it.

The user's optimizer class is rebuilt over the chunks: same class, same defaults, one param
group per user group with that group's hyperparameters, whose params are this rank's chunks
of that group's units (one chunk per unit). An LR scheduler on ``engine.optimizer`` works as
usual because it only edits ``param_groups``.

Note [masters]: in fp32 a master chunk IS the parameter storage (a view into the unit's full
buffer, or stage 3's shard), so the update lands in the model with no copy and no extra
memory. In bf16/fp16 each group gets one fp32 flat tensor and the chunks are views into it.

The step runs unit by unit over chunks (scale, norm, update, copy back), so a later offload
policy can move chunks elsewhere and stream them through the same loop.
"""

from __future__ import annotations

import inspect
import math

import torch

from zerorun.zero import collectives
from zerorun.zero.grad_reduce import GradReducer, ReducePolicy
from zerorun.zero.precision import LossScaler
from zerorun.zero.units import FlatUnit


def rebuild_optimizer(user_optimizer: torch.optim.Optimizer, group_chunks: list[list[torch.Tensor]]):
    """Same class, defaults and per-group hyperparameters, over the given tensors."""
    groups = []
    for user_group, chunks in zip(user_optimizer.param_groups, group_chunks):
        settings = {k: v for k, v in user_group.items() if k != "params"}
        groups.append({"params": chunks, **settings})
    cls = type(user_optimizer)
    # ``defaults`` can hold keys the constructor does not take (AdamW adds one); every group
    # already carries its full settings, so only pass what the constructor accepts.
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in user_optimizer.defaults.items() if k in accepted}
    return cls(groups, **defaults)


class ShardedOptimizer:
    def __init__(
        self,
        user_optimizer: torch.optim.Optimizer,
        units: list[FlatUnit],
        reducer: GradReducer,
        group,
        *,
        data_parallel_world: int,
        shard_world: int,
    ):
        self.units = units
        self.reducer = reducer
        self.group = group
        self.data_parallel_world = data_parallel_world
        self.shard_world = shard_world
        self.masters: list[torch.Tensor] = [None] * len(units)
        self.own_master_storage: list[torch.Tensor] = []
        for group_index in range(len(user_optimizer.param_groups)):
            members = [u for u in units if u.group_index == group_index]
            if members and members[0].dtype != torch.float32:
                flat = torch.empty(sum(u.layout.chunk_numel for u in members), dtype=torch.float32, device=members[0].device)
                self.own_master_storage.append(flat)
                position = 0
                for unit in members:
                    chunk = flat[position : position + unit.layout.chunk_numel]
                    chunk.copy_(unit.shard)
                    self.masters[unit.index] = chunk
                    position += unit.layout.chunk_numel
            else:
                for unit in members:
                    self.masters[unit.index] = unit.shard
        group_chunks = [
            [self.masters[u.index] for u in units if u.group_index == g]
            for g in range(len(user_optimizer.param_groups))
        ]
        self.optimizer = rebuild_optimizer(user_optimizer, group_chunks)

    def _master_grads(self) -> list[torch.Tensor]:
        grads = []
        for unit, master, chunk in zip(self.units, self.masters, self.reducer.grad_chunks):
            # ALL_REDUCE chunks are in the model dtype; fp32 ones are used in place. A lazy
            # shard is missing only if no backward ran in this window: its gradient is zero.
            if chunk is None:
                grad = torch.zeros_like(master)
            else:
                grad = chunk if chunk.dtype == torch.float32 else chunk.float()
            master.grad = grad
            grads.append(grad)
        return grads

    def step(self, *, loss_scaler: LossScaler, clip: float) -> tuple[bool, float | None]:
        """Unscale, check overflow, clip, update, spread. Returns (applied, grad_norm)."""
        grads = self._master_grads()
        inverse = 1.0 / (self.data_parallel_world * loss_scaler.scale)
        if grads:
            torch._foreach_mul_(grads, inverse)
        norm = None
        overflow = False
        if clip > 0 or loss_scaler.dynamic or loss_scaler.scale != 1.0:
            norm = self._global_norm(grads)
            overflow = not math.isfinite(norm)
        applied = loss_scaler.update(overflow)
        if applied:
            if clip > 0 and norm > clip:
                torch._foreach_mul_(grads, clip / (norm + 1e-6))
            self.optimizer.step()
            self._publish()
        for master in self.masters:
            master.grad = None
        self.reducer.zero()
        return applied, norm

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm over every rank's chunks; padding is zero, tied weights are counted once."""
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in grads:
            squares += grad.float().pow(2).sum()
        if self.shard_world > 1:
            collectives.all_reduce(squares, group=self.group)
        return float(squares.sqrt())

    def _publish(self) -> None:
        """Make the updated masters visible to the model on every rank."""
        with torch.no_grad():
            for unit, master in zip(self.units, self.masters):
                if master.data_ptr() != unit.shard.data_ptr():
                    unit.shard.copy_(master)
            handles = [u.start_refresh(self.group) for u in self.units if not u.partitioned]
            for handle in handles:
                handle.wait()

    def state_nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.own_master_storage)
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total
