"""Stage 3: gather a module's partitioned parameters just before it runs, free them after.

Forward: a pre-hook gathers the units holding the module's own parameters (waiting on a
prefetch when one was issued) and prefetches the units of the module that ran next in the
previous forward; a post-hook releases them and, when autograd will come back, hooks the
module's outputs so the units are gathered again right before the module's backward.
Backward: units are released as soon as all their gradients have arrived (the reducer tells
us), and anything still gathered is released when backward ends. A recomputation for activation
checkpointing, of any kind, is a pass state of its own (RECOMPUTE, Note [pass state] in
gather_pass.py): its calls gather and hold their units, record nothing, and release nothing.
What is gathered ahead, and how far, is gather_prefetch.py's (Note [execution order], Note
[prefetch budget]), along the orders recorded here.

Note [gather follows use]: a unit is planned with an owner (unit/plan.py), but a model may use
a parameter without calling its owner's forward: OPT's ``OPTForCausalLM`` calls
``self.model.decoder``, never ``self.model`` (the owner of the decoder's embeddings); PEFT makes
``PeftModel.forward`` be ``LoraModel.forward``, so ``LoraModel``'s hooks never fire. So every
module that directly holds a partitioned parameter (``holder_records``) has hooks too. When it
runs while a running gatherer holds its units (``in_use > 0``: the owner's call encloses it,
the common path), its hook does nothing: no gather, no place in the recorded order. When a
unit of its own parameters is held by no running call (a *stranded* use), the module gathers
that unit itself from then on (``_promote``), around its forward and again before its
backward, so the use is correct from the first call. Promotion alone would gather a unit once
per holder (every Linear and norm of OPT's decoder); so the calls are observed (the first
forward, and the next one after any stranded use: gather_use.py), and at the end of the
observed forward each stranded unit moves to the innermost module call that enclosed all its
uses (``common_caller``: OPT's decoder, Llama's model under PEFT), which gathers it once per
forward from the next forward on. Gradients need nothing: autograd sums a parameter's uses
into one accumulation, whose hook reduces the unit once (grad_reduce.py).

Note [shared units]: a unit used by several modules (a tied embedding and output head) would
otherwise stay gathered from the first of their backwards to the last, because its gradient
arrives only once every use has contributed (33.5 MB of the 33.7M GPT for all of backward). So
after each sharing module's backward the shared unit is released, and gathered again only by a
module whose backward reads it; an Embedding's backward needs only the indices, so it gathers
nothing. "After the backward" is an identity autograd function on the module's inputs
(``AfterBackward``, gather_plan.py), which runs once the module's whole backward has produced their
gradients. A hook on the input tensor itself ran too early when that tensor is another
gathering module's output: BART's decoder output feeds the tied head, and the tensor's hooks
ran in registration order, the model's gather before the head's release, so the model's
backward found the shared unit released.

Note [hooks on views]: "right before the module's backward" is a hook on the tensors the module
returned. A Linear on 3-d input returns a view of its matmul's output, and a model may add to
that view in place (RoCBert's embeddings: ``embedding_in += token_type_embeddings``): autograd
then rebuilds the view's history and the hook registered on it never fires, so the module's
units were never gathered for its backward, saved only while the predicted prefetch happened to
reach them (after a recomputation the next backward follows the observed order, which lacked
the module: "setStorage ... storage of size 0"). A hook on the view's base survives the
in-place change, and fires at the same point: the view's gradient flows straight into it.

Note [kept gathered]: from the recorded order, these units skip the release after a
module's forward, because gathering them again would come soon and cost more than holding them:
- a unit used again later in the same forward, with at most ``max_reuse_distance`` elements of
  other units gathered in between (DeepSpeed's stage3_max_reuse_distance): a tied embedding
  and output head is gathered once per forward, not twice;
- the units of the module that ran last (the output head): its backward is the first to run,
  right after the loss, so they are held through it (FSDP2 keeps its root unit the same way);
- with a prefetch budget, the units backward uses first, within it (Note [forward runs on into
  backward] in gather_prefetch.py).
On a CPU host every gather of a unit above glibc's 32 MiB mmap ceiling is fresh memory that
page-faults in (the 33.7M GPT's tied 33.5 MB embedding was gathered 3 times per step); holding
it costs no peak, since backward's start (the head's) holds it anyway. A forward that leaves
the recorded order keeps nothing, and a forward without autograd keeps nothing at its end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from zerorun.errors import UsageError
from zerorun.zero import param_access
from zerorun.zero.gather_pass import PassState, PassTracker, in_backward
from zerorun.zero.gather_plan import (
    AfterBackward, plan_kept_units, reads_params_in_backward, tensors_in,
)
from zerorun.zero.gather_prefetch import Prefetcher
from zerorun.zero.gather_use import CallObserver, common_caller
from zerorun.zero.lookup_rows import RowsFirst
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import GatherPool, ParamState


def _eager(hook):
    """Note [hooks outside the graph]: torch.compile of the model (before or after ``initialize``)
    traces module calls and their hooks; ours gather and release storage through collectives,
    which dynamo cannot trace. Disabled for dynamo, each runs eagerly at a graph break (a few
    per module that gathers), and the graphs between them hold only the model's own compute."""
    return torch.compiler.disable(hook, recursive=True)


class ParamGatherer:
    """Gathers and releases records' units; each record carries its own counts and plan in
    ``record.gathering`` (unit/parts.py), which only this class writes."""

    def __init__(self, root: nn.Module, module_records: dict[nn.Module, list[UnitRecord]], group,
                 *, max_reuse_distance: int = 0, holder_records: dict[nn.Module, list[UnitRecord]] | None = None,
                 leaf_units: frozenset[int] = frozenset(), prefetch_elements: int = 0,
                 turn_elements: int | None = None, max_live_elements: int | None = None):
        self.max_reuse_distance = max_reuse_distance
        # Note [expert gradients] (grad_reduce.py): units closed when their module's backward is
        # over, through ``on_backward_over`` (the engine's reducer); per unit, the calls of this
        # forward whose backward has not ended yet.
        self.leaf_units = leaf_units
        self.on_backward_over: Callable[[UnitRecord], None] | None = None
        self._open_calls: dict[int, int] = {}
        self.module_records = {m: list(rs) for m, rs in module_records.items()}  # the gathering modules
        # Note [gather follows use]: every module holding a partitioned parameter, with its units.
        self.holder_records = holder_records or {}
        self.group = group
        every = [r for rs in list(module_records.values()) + list(self.holder_records.values()) for r in rs]
        self.records = sorted({r.index: r for r in every}.values(), key=lambda r: r.index)
        self.pool = None
        if self.records and self.records[0].unit.device.type == "cpu" and GatherPool.SUPPORTED:
            self.pool = GatherPool()  # Note [gather pool] in unit/storage.py
            for record in self.records:
                record.unit.pool = self.pool
        self.forward_order: list[nn.Module] = []
        self._recording: list[nn.Module] = []
        # Note [execution order] and Note [prefetch budget] (gather_prefetch.py): the gathers
        # issued ahead along the recorded orders.
        self.prefetcher = Prefetcher(self._records_of, group, self.pool, prefetch_elements=prefetch_elements,
                                     turn_elements=turn_elements, max_live_elements=max_live_elements)
        self._finished: list[nn.Module] = []
        # Note [pass state] (gather_pass.py): the pass now running; per recomputing call (a
        # stack), the records it holds; backward's order as forward predicts it, and as this
        # backward gathered (recomputations included), first appearances only.
        self.passes = PassTracker()
        self._recompute_held: list[list[UnitRecord]] = []
        self._predicted_backward: list[nn.Module] = []
        self._observed_backward: dict[nn.Module, None] = {}
        self._recomputed = False
        # Note [gradients per recomputation] (grad_reduce.py): the autograd graph task of this
        # backward's own graph, seen by its first hook (a reentrant region's graph nests in it).
        self._backward_task: int | None = None
        self._calls: list[int] = []  # positions of the module calls now running (a stack)
        self._on_order = True  # this forward has followed forward_order so far
        # Note [gather follows use]: stranded uses found in this forward, per record: the module
        # that held the parameter and the call stack around it (None when not observing).
        self._stranded: dict[UnitRecord, list[tuple[nn.Module | None, tuple[nn.Module, ...] | None]]] = {}
        self._observer = CallObserver(root)
        self._observe_next = True  # the first forward is observed
        self._hooked: set[nn.Module] = set()
        # Note [reads outside forward] (param_access.py): units read during this forward outside
        # any gathering module, held (``in_use``) until its backward is over.
        self._pinned: list[UnitRecord] = []
        # Note [reads outside forward]: per partitioned record, the switch that keeps its
        # parameters' reads seen while the unit stays gathered between uses in a forward
        # (``_watch_kept``), and the records so switched now.
        self._watch = {
            record: param_access.guard(record.unit, functools.partial(self.read, record))
            for record in self.records if record.unit.partitioned
        }
        self._watched: set[UnitRecord] = set()
        for module in list(self.module_records) + list(self.holder_records):  # hooks for the model's lifetime
            self._hook(module)
        for records in self.module_records.values():
            for record in records:
                record.gathering.add_user()
        for record in self.records:
            if record.unit.partitioned:
                record.unit.state_listeners.append(self.prefetcher.count_live)
                self.prefetcher.count_live(record.unit)
        # Note [next forward's gathers in the step] (step_gathers.py): told when a forward starts.
        self.on_forward_start: list[Callable[[], None]] = []
        # Note [lookup rows first] (lookup_rows.py): the tied lookups that may read rows instead
        # of their gathered unit (set by the engine; it knows the calls now doing so).
        self.rows_first: RowsFirst | None = None
        self.root = root
        root.register_forward_pre_hook(_eager(self._root_pre_forward), prepend=True)
        root.register_forward_hook(_eager(self._root_post_forward))

    def _hook(self, module: nn.Module) -> None:
        if module not in self._hooked:
            self._hooked.add(module)
            module.register_forward_pre_hook(_eager(self._pre_forward), with_kwargs=True)
            # always_call (Note [anyone's checkpoint] in activation_checkpointing.py): a recomputation
            # that torch stops early (it raises out of the forward once it has what backward needs)
            # still lets go of what its calls hold, so any checkpoint may keep torch's early stop.
            module.register_forward_hook(_eager(self._post_forward), always_call=True)

    def _records_of(self, module: nn.Module) -> list[UnitRecord]:
        return self.module_records.get(module, [])

    # -- forward ------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if self.passes.state is not PassState.FORWARD and in_backward():
            return  # the whole model recomputed: its calls are RECOMPUTE's (Note [pass state])
        if self.passes.state is PassState.IDLE:  # no backward pending: count this forward's calls afresh
            for record in self.records:
                record.gathering.forget_calls()
        self.passes.move(PassState.FORWARD)
        for told in self.on_forward_start:
            told()
        if self.pool is not None:
            self.pool.expect(None)  # forward keeps what it releases: the next module takes it
        self._recording = []
        self._finished = []
        self._calls = []
        self._on_order = True
        if self._observe_next and not self._observer.active:
            self._undo_promotions()
            self._observer.start()

    def next_forward_gathers(self) -> list[UnitRecord]:
        """Note [next forward's gathers in the step] (step_gathers.py): what the step gathers for
        the next forward, up to its first call that reads rows (Note [lookup rows first]): the
        rows go first on the link, and the table is gathered at the head."""
        rows_first = self.rows_first
        return self.prefetcher.next_forward_gathers(rows_first.would_serve if rows_first is not None else None)

    # -- Note [gather follows use] ----------------------------------------------------------
    def _promote(self, module: nn.Module, stranded: list[UnitRecord]) -> None:
        """``module`` runs while units of its own parameters are gathered by no running module:
        from now on it gathers them itself; the end of forward may move that to its caller."""
        self.module_records.setdefault(module, []).extend(stranded)
        stack = self._observer.stack() if self._observer.active else None
        for record in stranded:
            self._stranded.setdefault(record, []).append((module, stack))
        if stack is None:
            self._observe_next = True

    def read(self, record: UnitRecord, param: nn.Parameter) -> UsageError | None:
        """Note [reads outside forward]: ``param`` of ``record``'s unit is read while no module
        call gathers it. In a forward: gather and hold it, and note the use for the plan."""
        # Autograd's own reads in backward count too: a compiled backward (AOT autograd) checks
        # the parameters it saved.
        in_autograd = self.passes.state is PassState.BACKWARD and in_backward()
        if self.passes.state not in (PassState.FORWARD, PassState.RECOMPUTE) and not in_autograd:
            name = next(n for n, p in zip(record.unit.names, record.unit.params, strict=True) if p is param)
            return param_access.refusal(name)
        record.gathering.hold()
        self._pinned.append(record)
        record.unit.gather(self.group)
        if self.passes.state is not PassState.FORWARD:
            self._see_backward_task()
            return None  # the plan is forward's: a recomputation or a backward repeats it
        self._unwatch(record)
        stack = self._observer.stack() if self._observer.active else None
        self._stranded.setdefault(record, []).append((None, stack))
        if stack is None:
            self._observe_next = True
        return None

    def _watch_kept(self, record: UnitRecord) -> None:
        """``record``'s unit stays gathered after a module's forward for a later use, while no
        running call holds it: its parameters get the sharded class again, so that a read by a
        module that does not gather it (a parent's forward reading a tied weight) gathers and
        holds it like a read of a released unit (Note [reads outside forward])."""
        watch = self._watch.get(record)
        if watch is not None and self.passes.state is PassState.FORWARD:
            watch(True)
            self._watched.add(record)

    def _unwatch(self, record: UnitRecord) -> None:
        if record in self._watched:
            self._watched.discard(record)
            self._watch[record](False)

    def _unwatch_all(self) -> None:
        """End of forward: a unit still gathered is held into backward, where reads are
        autograd's (Note [kept gathered]); its parameters are plain again."""
        for record in list(self._watched):
            self._unwatch(record)

    def _unpin(self) -> None:
        for record in self._pinned:
            record.gathering.let_go()
        self._pinned = []

    def _undo_promotions(self) -> None:
        for record, uses in self._stranded.items():
            for module, _ in uses:
                self._demote(module, record)
        self._stranded = {}

    def _demote(self, module: nn.Module | None, record: UnitRecord) -> None:
        if module is None:  # a read, not a promotion (Note [reads outside forward])
            return
        records = self.module_records.get(module)
        if records is not None and record in records:
            records.remove(record)
            if not records:
                del self.module_records[module]

    def _plan_stranded(self) -> None:
        """End of an observed forward: each stranded unit is gathered from now on by the
        innermost module call that enclosed all its uses (Note [gather follows use])."""
        self._observer.stop()
        self._observe_next = False
        for record, uses in self._stranded.items():
            stacks = [stack for _, stack in uses]
            if any(stack is None for stack in stacks):
                self._observe_next = True
                continue
            caller = common_caller(stacks)  # type: ignore[arg-type]  # None filtered above
            if caller is None:
                continue
            for module, _ in uses:
                self._demote(module, record)
            if record not in self._records_of(caller):
                self.module_records.setdefault(caller, []).append(record)
                record.gathering.add_user()
                self._hook(caller)
        self._stranded = {}

    def _pre_forward(self, module, args, kwargs):
        if self.passes.enter_call():
            self._pre_recompute(module)
            return None
        holds = self.holder_records.get(module)
        if holds:
            own = self._records_of(module)
            stranded = [r for r in holds if r.gathering.in_use == 0 and r not in own]
            if stranded:
                self._promote(module, stranded)
        records = self.module_records.get(module)
        if not records:
            return None  # a holder whose units a running caller already gathered: the common path
        position = len(self._recording)
        self._on_order = (self._on_order and position < len(self.forward_order)
                          and self.forward_order[position] is module)
        self._calls.append(position)
        self._recording.append(module)
        served = (self.rows_first.serve(module, args)
                  if self.rows_first is not None and self.passes.state is PassState.FORWARD else None)
        if served is not None:  # Note [lookup rows first]: no gather, no hold for this call
            served.gathering.read_rows()
        for record in records:
            record.gathering.count_call()
            if record is served:
                continue
            record.gathering.hold()
            record.unit.gather(self.group)
            self._unwatch(record)
        self.prefetcher.forward(self.forward_order, module, self._on_order)
        if torch.is_grad_enabled() and any(_released_after_backward(r) or r.index in self.leaf_units
                                           for r in records):
            return self._hook_inputs(module, args, kwargs)
        return None

    def _pre_recompute(self, module: nn.Module) -> None:
        """RECOMPUTE (Note [pass state]): the call holds its module's units, and those of its own
        parameters no running call holds (Hugging Face checkpoints a layer's ``forward``, not its
        call, so the layer's own hooks stay outside the recomputation)."""
        held = list(self._records_of(module))
        held += [r for r in self.holder_records.get(module, ()) if r.gathering.in_use == 0 and r not in held]
        for record in held:
            record.gathering.hold()
            record.unit.gather(self.group)
        self._recompute_held.append(held)
        self._recomputed = True
        self._see_backward_task()
        if held:
            self._note_backward(module)

    def _post_forward(self, module, args, output) -> None:
        if self.passes.recomputing:
            # Note [pass state]: no release in a recomputation; the tensors it saves alias the
            # gathered storage and the region's backward runs next. Its units are released when
            # their gradients arrive or backward ends.
            for record in self._recompute_held.pop():
                record.gathering.let_go()
            self.passes.leave_call(True)
            return
        records = self.module_records.get(module)
        if not records:
            return
        served = self.rows_first.restore(module) if self.rows_first is not None else None
        position = self._calls.pop() if self._calls else -1  # in forward_order
        for record in records:
            if record is served:
                continue
            record.gathering.let_go()
            # Note [kept gathered]; Note [forward runs on into backward] (gather_prefetch.py)
            kept = self._on_order and (position in record.gathering.keep_after
                                       or record.index in self.prefetcher.held_for_backward)
            if record.gathering.in_use == 0:
                if kept:
                    self._watch_kept(record)
                else:
                    record.unit.release()
        if torch.is_grad_enabled() and output is not None:
            self._finished.append(module)
            self._hook_outputs(module, output)

    def _root_post_forward(self, module, args, output) -> None:
        if self.passes.state is not PassState.FORWARD:
            return  # the whole model recomputed in backward (Note [pass state])
        self.passes.move(PassState.BACKWARD if torch.is_grad_enabled() else PassState.IDLE)
        self._unwatch_all()
        if not torch.is_grad_enabled():
            self._unpin()
        if self._observer.active:
            self._plan_stranded()
        if self._finished:
            backward = [m for m in reversed(self._finished) if reads_params_in_backward(m)]
            if backward != self._predicted_backward:
                self._predicted_backward = backward
                self.prefetcher.follow_backward(backward)
        if self._recording != self.forward_order:
            self.forward_order = list(self._recording)
            self.prefetcher.follow_forward(self.forward_order)
            keep_after, keep_for_backward = plan_kept_units(
                [[r.index for r in self._records_of(m)] for m in self.forward_order],
                {r.index: r.unit.layout.numel for r in self.records}, self.max_reuse_distance,
            )
            for record in self.records:
                record.gathering.plan(frozenset(p for p, kept in keep_after.items() if record.index in kept),
                                      record.index in keep_for_backward)
        self._release_idle(for_backward=torch.is_grad_enabled())

    def _note_backward(self, module: nn.Module) -> None:
        """``module``'s units are gathered in backward (before its backward, or for its
        recomputation): note the order, prefetch the next ones."""
        self._observed_backward.setdefault(module, None)
        self.prefetcher.backward(module)

    # -- backward -----------------------------------------------------------------------
    def _hook_outputs(self, module: nn.Module, output) -> None:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if not tensors:
            return

        # This call's units: the end of forward may move a stranded unit to another module.
        records = list(self._records_of(module)) if reads_params_in_backward(module) else []

        def before_backward(grad):
            if self.passes.state is PassState.IDLE:
                self.passes.move(PassState.BACKWARD)
            self._see_backward_task()
            for record in records:
                record.unit.gather(self.group)
            self._note_backward(module)
            return grad

        # Note [hooks on views]: a hook on a view is lost when the view is changed in place (autograd
        # rebuilds its history), so a view's hook goes on its base while that base is an
        # intermediate result (a leaf's hooks would outlive this pass).
        targets = {}
        for tensor in tensors:
            base = tensor._base
            target = base if base is not None and base.grad_fn is not None else tensor
            targets[id(target)] = target
        for target in targets.values():
            target.register_hook(before_backward)

    def _hook_inputs(self, module: nn.Module, args, kwargs):
        """Release ``module``'s shared units once its backward is over (Note [shared units]):
        its inputs pass through ``AfterBackward``, whose backward runs when the module's whole
        backward has produced their gradients, and so before the backward hook of the module
        that made them (a tensor hook on the same input would run after that hook's gather)."""
        records = [r for r in self._records_of(module) if _released_after_backward(r)]
        closing = [r for r in self._records_of(module) if r.index in self.leaf_units]

        def after_backward() -> None:
            if not self.passes.recomputing:
                for record in records:
                    if record.gathering.in_use == 0:
                        record.unit.release()
                for record in closing:  # Note [expert gradients]
                    self._open_calls[record.index] -= 1
                    if self._open_calls[record.index] == 0 and self.on_backward_over is not None:
                        self.on_backward_over(record)

        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
        if not positions:
            return None  # no backward reaches the inputs: the end of backward closes the units
        for record in closing:
            self._open_calls[record.index] = self._open_calls.get(record.index, 0) + 1
        passed = AfterBackward.apply(after_backward, *(leaves[i] for i in positions))
        for i, tensor in zip(positions, passed, strict=True):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def _see_backward_task(self) -> None:
        if self._backward_task is None:
            self._backward_task = torch._C._current_graph_task_id()

    def arrivals_per_param(self, record: UnitRecord) -> int:
        """Note [gradients per recomputation] (grad_reduce.py): how many times each parameter of
        ``record``'s unit arrives in this backward, asked at its first arrival. Once, when that
        arrival comes from backward's own graph; once per call that gathered the unit in forward
        when it comes from a graph nested in it (a reentrant checkpoint's region)."""
        calls = record.gathering.calls
        if calls <= 1 or self._backward_task is None:
            return 1
        return 1 if torch._C._current_graph_task_id() == self._backward_task else calls

    def unit_grads_done(self, record: UnitRecord) -> None:
        """All of ``record``'s gradients arrived: its values are not needed any more."""
        if record.unit.partitioned and record.gathering.in_use == 0:
            record.unit.release()

    def finish_backward(self) -> None:
        """Backward is over. When it recomputed, the order it gathered in (recomputations
        included) is the order the next backward prefetches by; forward's prediction knows no
        recomputation."""
        self._unpin()
        self._release_idle()
        if self._recomputed and list(self._observed_backward) != self.prefetcher.backward_order:
            self.prefetcher.follow_backward(list(self._observed_backward))
        self._observed_backward = {}
        self._recomputed = False
        self._backward_task = None
        self._open_calls.clear()
        self.passes.move(PassState.IDLE)

    def _release_idle(self, for_backward: bool = False) -> None:
        ahead = self.prefetcher.held_for_backward if for_backward else frozenset()
        self.prefetcher.held_for_backward = frozenset()
        for record in self.records:
            held = for_backward and (record.gathering.keep_for_backward or record.index in ahead)
            if record.gathering.in_use == 0 and record.unit.state is not ParamState.SHARDED and not held:
                record.unit.release()

    def release_all(self) -> None:
        """Release every idle unit, invalidate hpZ's secondary copies and let the pool go (at each
        step, before the update; before a checkpoint load rewrites shards)."""
        self._unpin()
        self._release_idle()
        for record in self.records:  # the shards change next (Note [secondary copy] in unit/secondary.py)
            if record.unit.secondary is not None:
                record.unit.secondary.invalidate()
        if self.pool is not None:
            self.pool.clear()
        self._backward_task = None
        self.passes.move(PassState.IDLE)

    def pool_nbytes(self) -> int:
        return self.pool.nbytes() if self.pool is not None else 0


def _released_after_backward(record: UnitRecord) -> bool:
    """A shared unit (Note [shared units]), or a frozen one, whose release no gradient's arrival
    triggers (Note [frozen units] in unit/partition.py): released once the module's backward is over."""
    return record.gathering.users > 1 or record.unit.frozen
