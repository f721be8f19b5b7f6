"""Stage 3: which pass the model is in, as the gatherer sees it (Note [pass state]).

    pytest tests/unit/test_gather_pass.py

Note [pass state]: the gatherer (param_gather.py) is in exactly one of four states, moved only
through ``PassTracker.move`` (an illegal move is an InternalError, never a guess from which
fields are None). FSDP2's ``TrainingState`` is the model of the idea.

IDLE       no pass runs. Every unit is SHARDED (its ``shard`` alone), except units kept for a
           backward that never came (released at the next step's ``release_all``).
FORWARD    the model's forward runs: a module call holds its units (``in_use``) and frees
           them after it, the calls are recorded into the order the next passes prefetch by,
           and a unit kept for a later use stays gathered (Note [kept gathered]).
RECOMPUTE  backward re-runs part of the forward for activation checkpointing, of any kind
           (torch.utils.checkpoint reentrant or not, as Hugging Face's
           ``gradient_checkpointing_enable`` uses it; zerorun's own; ``deepspeed.checkpointing``).
           A call holds its units for the call, but the call does NOT free them: the tensors the
           recomputation saves alias the gathered storage and the region's backward runs next.
           They are freed when their gradients have arrived (``unit_grads_done``) or backward
           ends. Nothing is recorded into the forward order; backward's order is (below).
BACKWARD   autograd runs backward: a module's units are gathered right before its backward
           (hooks on its forward outputs), prefetched along the order the previous backward
           gathered in, recomputations included, and freed once their gradients have arrived.

A recomputation is recognised by where it runs, not by who started it: a module call while
autograd's engine is executing a graph (``torch._C._current_graph_task_id() >= 0``) is part
of backward, whoever called ``checkpoint``. Recomputations nest (a checkpointed region inside
another); ``depth`` counts them.
"""

from __future__ import annotations

import enum

import torch

from zerorun.errors import InternalError
from zerorun.zero.activation_checkpointing import is_recomputing


class PassState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"


# A forward may follow a forward whose output never reached backward (a metric computed with
# grad on), and a forward may start from BACKWARD's pending state (a second micro-batch's
# forward before the first's backward, as gradient accumulation with summed losses does).
_ALLOWED = {
    PassState.IDLE: {PassState.FORWARD, PassState.RECOMPUTE, PassState.BACKWARD},
    PassState.FORWARD: {PassState.IDLE, PassState.BACKWARD},
    PassState.BACKWARD: {PassState.FORWARD, PassState.RECOMPUTE, PassState.IDLE},
    PassState.RECOMPUTE: {PassState.BACKWARD},
}


def in_backward() -> bool:
    """True while autograd's engine executes a graph on this thread (a recomputation runs there),
    or while zerorun's own checkpointing recomputes."""
    return torch._C._current_graph_task_id() >= 0 or is_recomputing()


class PassTracker:
    """The gatherer's pass state and its transitions (Note [pass state])."""

    def __init__(self) -> None:
        self.state = PassState.IDLE
        self.depth = 0  # recomputing module calls now running (RECOMPUTE while > 0)

    def move(self, new: PassState) -> None:
        if new is self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise InternalError(f"stage 3 pass state {self.state.name} -> {new.name} is not a transition")
        self.state = new

    def enter_call(self) -> bool:
        """A hooked module call starts; True when it is a recomputation (moves to RECOMPUTE)."""
        # In FORWARD a call inside autograd's engine is a forward's own use of autograd (a
        # gradient penalty's torch.autograd.grad), not a recomputation.
        if self.state is PassState.RECOMPUTE or (self.state is not PassState.FORWARD and in_backward()):
            self.move(PassState.RECOMPUTE)
            self.depth += 1
            return True
        return False

    def leave_call(self, recomputing: bool) -> None:
        if not recomputing:
            return
        if self.state is not PassState.RECOMPUTE or self.depth == 0:
            raise InternalError(f"a recomputing call ended in stage 3 pass state {self.state.name}")
        self.depth -= 1
        if self.depth == 0:
            self.move(PassState.BACKWARD)

    @property
    def recomputing(self) -> bool:
        return self.state is PassState.RECOMPUTE
