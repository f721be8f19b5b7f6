"""Load a checkpoint (checkpoint/save.py wrote it) into an engine of any world size and stage.

``pytest tests/distributed/test_checkpoint_reshard.py tests/distributed/test_checkpoint_failures.py tests/unit/test_checkpoint_safety.py`` runs its tests; the engine calls it:

    path, client_state = engine.load_checkpoint(dir, tag=None)      # every rank, any world/stage

Note [loading]: every rank reads only the pieces its records need (reshard.plan_reads), from
whichever saved files hold them, after checking those files' sizes and checksums. Per-element
optimizer state (Adam's exp_avg / exp_avg_sq) is re-partitioned like the masters; scalar state
(Adam's ``step``) is taken as saved. Masters are then published into the model and replicated
units (stages 1-2) refreshed with the usual all-gather, so the model holds exactly the values
an update would have left.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from zerorun.errors import CheckpointError
from zerorun.telemetry import get_recorder
from zerorun.worker.device import storage_home
from zerorun.zero import full_state
from zerorun.zero.checkpoint.agreement import together
from zerorun.zero.checkpoint.format import (ENGINE_FILE, LATEST, Reader, decode_scalar, frozen_and_buffers,
                                           master_index, model_table, rank_file, read_manifest, resolve)
from zerorun.zero.checkpoint.reshard import FROZEN, RNG, Uncovered, first_mismatch, index_pieces, plan_reads, whole_key
from zerorun.zero.checkpoint.rng import load_rng
from zerorun.zero.checkpoint.tensor_files import load_refusal
from zerorun.zero.unit.layout import Segment
from zerorun.zero.refresh_ahead import EagerRefresh
from zerorun.zero.update import replicated_units


def _check_fits(engine, manifest: dict, directory: Path) -> None:
    table = model_table(engine.module)
    shapes = lambda section: {n: i["shape"] for n, i in section.items()}
    problem = (first_mismatch(shapes(manifest["parameters"]), shapes(table["parameters"]))
               or first_mismatch(shapes(manifest["buffers"]), shapes(table["buffers"]), what="buffer"))
    if problem:
        raise CheckpointError(f"checkpoint {str(directory)!r} does not fit this model: {problem}",
                              hint="load it into the model it was saved from (same names and shapes)")


def _check_optimizer(engine, manifest: dict, directory: Path) -> None:
    """The optimizer state fits this optimizer: same type, same number of param groups, each
    parameter in the same group (format version 2 records the last two)."""
    saved, ours = manifest.get("optimizer"), type(engine.train_state.optimizer).__name__
    hint = "build the same optimizer, or pass load_optimizer_states=False to load the weights only"
    if saved != ours:
        raise CheckpointError(f"checkpoint {str(directory)!r} holds {saved} optimizer state; this engine's optimizer "
                              f"is {ours}", hint=hint)
    groups = manifest.get("param_groups")
    if groups is not None and groups != len(engine.train_state.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {str(directory)!r} has {groups} optimizer param group(s); this optimizer "
                              f"has {len(engine.train_state.optimizer.param_groups)}", hint=hint)
    group_of = manifest.get("group_of", {})
    for record in engine.records:
        for seg in record.segments:
            if seg.name in group_of and group_of[seg.name] != record.unit.group_index:
                raise CheckpointError(f"checkpoint {str(directory)!r} has parameter {seg.name!r} in optimizer param "
                                      f"group {group_of[seg.name]}; this optimizer has it in group {record.unit.group_index}",
                                      hint=hint)


def load_checkpoint(engine, load_dir, tag: str | None = None, *, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Load into ``engine`` (every rank): returns (checkpoint path, client state), or
    (None, None) when ``load_dir`` holds no checkpoint yet (as DeepSpeed does).

    Note [all or nothing]: everything that can refuse (the manifest, the model's shapes, the
    optimizer's type and groups, engine.pt and its client state, the size and checksum of
    every file this rank reads, the coverage of every piece) is checked before the engine
    changes; only then are values copied in. A refused load leaves the engine as it was."""
    optimizer_states = load_optimizer_states and not load_module_only
    checked: dict = {}

    def check() -> None:
        directory = checked["directory"] = resolve(load_dir, tag, say=_say_on_rank0(engine))
        if directory is None:
            return
        manifest = checked["manifest"] = read_manifest(directory)
        _check_fits(engine, manifest, directory)
        if optimizer_states:
            _check_optimizer(engine, manifest, directory)
        reader = checked["reader"] = Reader(directory, manifest)
        checked["saved"] = None if load_module_only else _read_engine_state(engine, reader)
        checked["plans"] = _plan_records(engine, reader, manifest, optimizer_states)
        for name in _files_needed(engine, manifest, checked["plans"], rng=checked["saved"] is not None):
            reader.check(name)
        _check_whole_keys(engine, manifest, directory, rng=checked["saved"] is not None)

    try:
        # Every rank checks, then all agree (Note [failing together]): a file damaged for one
        # rank refuses the load on all, before any of them changed its engine.
        together(engine, check, f"checking checkpoint {str(load_dir)!r}", hint="nothing was loaded on any rank")
    except BaseException:
        if "reader" in checked:
            checked["reader"].close()
        raise
    directory = checked["directory"]
    if directory is None:
        if engine.pg.rank == 0:
            print(f"zerorun: no checkpoint in {str(load_dir)!r} yet (no {LATEST} file); nothing loaded",
                  file=sys.stderr, flush=True)
        return None, None
    manifest, reader, saved, plans = checked["manifest"], checked["reader"], checked["saved"], checked["plans"]
    try:
        _load_records(engine, reader, manifest, plans)
        _load_frozen_and_buffers(engine, reader, manifest)
        client_state = None
        if saved is not None:
            client_state = _apply_engine_state(engine, saved, load_lr_scheduler_states)
            if engine.pg.rank < manifest["world_size"]:
                load_rng(reader, manifest, engine.pg.rank)
    finally:
        reader.close()
    return str(directory), client_state


def _say_on_rank0(engine):
    """A ``say`` for format.resolve: one line on stderr from rank 0 (every rank resolves)."""
    def say(line: str) -> None:
        if engine.pg.rank == 0:
            print(line, file=sys.stderr, flush=True)
    return say


def _files_needed(engine, manifest: dict, plans: list, *, rng: bool) -> list[str]:
    names = {read.file for master_reads, state_reads, _ in plans for read in master_reads}
    names |= {read.file for _, state_reads, _ in plans for reads in state_reads.values() for read in reads}
    index = None
    for key, tensor in frozen_and_buffers(engine):
        names.add(rank_file(0))
        name = key.split("/", 1)[1]
        if key.startswith(FROZEN) and manifest["parameters"][name]["trainable"]:  # see _load_frozen_and_buffers
            index = index or master_index(manifest)[0]
            names |= {read.file for read in plan_reads([Segment(name, 0, 0, tensor.numel())], index)}
    if rng and engine.pg.rank < manifest["world_size"]:
        names.add(rank_file(engine.pg.rank))
    return sorted(names)


def _check_whole_keys(engine, manifest: dict, directory: Path, *, rng: bool) -> None:
    """Every whole tensor the load will read is one the manifest lists (and so, once its file
    is checked, one the file holds: Note [checked against its own files])."""
    wanted = [key for key, _ in frozen_and_buffers(engine)
              if not (key.startswith(FROZEN) and manifest["parameters"][key.split("/", 1)[1]]["trainable"])]
    missing = [key for key in wanted if key not in set(manifest["ranks"][0]["keys"])]
    if rng and engine.pg.rank < manifest["world_size"]:
        keys = set(manifest["ranks"][engine.pg.rank]["keys"])
        missing += [key for key in (whole_key(RNG, "torch"),) if key not in keys]
    if missing:
        raise CheckpointError(f"checkpoint {str(directory)!r} lists no tensor {missing[0]!r}",
                              hint="it is incomplete or from another model; load an earlier tag")


def _load_frozen_and_buffers(engine, reader: Reader, manifest: dict) -> None:
    """Whole tensors from rank 0's file; a parameter frozen now but trainable when saved is
    assembled from its master pieces."""
    index = None
    with torch.no_grad():
        for key, tensor in frozen_and_buffers(engine):
            name = key.split("/", 1)[1]
            if key.startswith(FROZEN) and manifest["parameters"][name]["trainable"]:
                index = index or master_index(manifest)[0]
                whole = torch.empty(tensor.numel(), dtype=torch.float32)
                reader.fill(plan_reads([Segment(name, 0, 0, tensor.numel())], index), whole)
                full_state.write_whole(engine, tensor, whole.view(tensor.shape))
            else:  # a stage-3 frozen parameter: into this rank's shard (Note [frozen units])
                full_state.write_whole(engine, tensor, reader.file(rank_file(0)).read(key))


def _plan_records(engine, reader: Reader, manifest: dict, optimizer_states: bool) -> list:
    """Per record: (master reads, {state family: reads}, scalars), every gap found before any
    value is read (Note [all or nothing])."""
    index, files = master_index(manifest)
    families = sorted({key.split("/", 1)[0] for keys in files.values() for key in keys if key.startswith("state.")})
    state_index = {family: index_pieces(files, family) for family in families} if optimizer_states else {}
    scalars: dict[str, dict] = {}
    for entry in manifest["ranks"]:
        scalars.update(entry["scalars"])
    plans = []
    for record in engine.records:
        try:
            master_reads = plan_reads(record.segments, index)
        except Uncovered as gap:
            raise CheckpointError(f"checkpoint {str(reader.directory)!r} has no saved values for parameter "
                                  f"{gap.name!r} (elements {gap.start}-{gap.end})", hint="it is incomplete or from another model") from None
        names = [seg.name for seg in record.segments]
        state_reads = {}
        for family, family_index in state_index.items():
            present = [name for name in names if name in family_index]
            if not present:
                continue
            if len(present) != len(names):
                raise CheckpointError(f"checkpoint {str(reader.directory)!r} has {family[6:]!r} optimizer state for "
                                      f"{present[0]!r} but not for {sorted(set(names) - set(present))[0]!r}",
                                      hint="pass load_optimizer_states=False to load the weights only")
            try:
                state_reads[family] = plan_reads(record.segments, family_index)
            except Uncovered as gap:
                raise CheckpointError(f"checkpoint {str(reader.directory)!r} lacks {family[6:]!r} optimizer state "
                                      f"for parameter {gap.name!r}") from None
        record_scalars = (scalars.get(names[0], {}) if names else {}) if optimizer_states else None
        plans.append((master_reads, state_reads, record_scalars))
    return plans


def _load_records(engine, reader: Reader, manifest: dict, plans: list) -> None:
    engine.quiesce()  # a unit left gathered would keep stale values
    optimizer = engine.train_state.optimizer
    loaded = 0
    for record, (master_reads, state_reads, record_scalars) in zip(engine.records, plans, strict=True):
        with record.state_home.resident(record, optimizer), torch.no_grad():
            reader.fill(master_reads, record.master)
            if record_scalars is not None:  # optimizer states are loaded (even when there are none)
                optimizer.state[record.master] = _record_state(record, reader, state_reads, record_scalars, optimizer)
            record.state_home.publish(record)
        loaded += record.master.numel() * 4 if record.master.numel() else record.unit.layout.chunk_numel * 4
        get_recorder().record_activity("loading", loaded)  # Note [saving is progress]
    get_recorder().record_activity(None, 0)
    engine.quiesce()
    EagerRefresh().start(replicated_units(engine.records), engine.pg.group)


def _record_state(record, reader: Reader, state_reads: dict, record_scalars: dict | None, optimizer) -> dict:
    """The optimizer state of one record, re-partitioned from the saved pieces."""
    state = {}
    for family, reads in state_reads.items():
        dtype = reader.file(reads[0].file).info(reads[0].key)[0] if reads else torch.float32
        tensor = torch.zeros(record.master.numel(), dtype=dtype, device=record.master.device)
        reader.fill(reads, tensor)  # (the caller holds no_grad)
        state[family[len("state."):]] = tensor
    if record_scalars:
        group = optimizer.param_groups[record.unit.group_index]
        device = record.master.device if (group.get("fused") or group.get("capturable")) else torch.device("cpu")
        for key, entry in record_scalars.items():
            state[key] = decode_scalar(entry, device)
    return state


def _read_engine_state(engine, reader: Reader) -> dict:
    path = reader.check(ENGINE_FILE)
    try:
        saved = torch.load(path, weights_only=True, map_location=storage_home(engine.pg.device))  # device contract
    except Exception as exc:  # the unpickler's refusals are many types
        raise CheckpointError(f"checkpoint file {str(reader.directory / ENGINE_FILE)!r} cannot be loaded "
                              f"({load_refusal(exc)})",
                              hint="it holds a client_state this version cannot read, or it is damaged") from None
    optimizer = engine.train_state.optimizer
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this one "
                              f"{len(optimizer.param_groups)}", hint="build the optimizer with the same groups")
    return saved


def _apply_engine_state(engine, saved: dict, load_scheduler: bool):
    engine.train_state.load_state_dict(saved, load_scheduler=load_scheduler)
    return saved["client_state"]


