"""Sharded, atomic, exactly resumable checkpoints of an engine.

``pytest tests/distributed/test_checkpoint.py`` runs its tests; the engine calls it:

    engine.save_checkpoint(dir, tag=None, client_state=None)        # every rank
    path, client_state = engine.load_checkpoint(dir, tag=None)      # every rank, any world/stage

One checkpoint is a directory (file names and reading: checkpoint/format.py; the pieces'
keys and the re-partitioning math: checkpoint/reshard.py; the streamed safetensors files: checkpoint/tensor_files.py):

    DIR/latest                   the newest complete tag; moved last (Note [commit order])
    DIR/TAG/manifest.json        layout, world size, stage, versions, a checksum per file, and per
                                 rank: its tensor keys, RNG states and scalar optimizer state
    DIR/TAG/rank{R}.safetensors  rank R's pieces (checkpoint/reshard.py): fp32 masters and per-element
                                 optimizer state by (parameter name, element range); R's torch
                                 RNG states; rank 0 also each frozen parameter and buffer, whole
    DIR/TAG/engine.pt            counters, accumulation position, loss scaler, LR scheduler,
                                 param-group hyper-parameters, the user's client state (rank 0)

Note [what a rank writes]: each rank writes the pieces of its own chunks (``record.segments``),
read from the record's master and ``optimizer.state[record.master]``, so no collective moves
any tensor and every element is written exactly once: at stage 0 (and at world size 1) the
chunk is the whole unit on every rank, and only rank 0 writes it. The model-dtype parameters
are not written: after every update they are the masters rounded to the model dtype, which is
what loading and consolidating recompute. Offloaded state is read where it lives: on the host
directly, from NVMe through the placement's ``begin_update`` / ``end_update`` (one unit's
buffer at a time, as an update would).

Note [commit order]: ranks write into ``TAG.partial`` (each file under a temporary name,
fsynced, renamed: checkpoint/tensor_files.py Note [atomic save]); after a barrier rank 0 writes the
manifest there, renames ``TAG.partial`` to ``TAG`` (an existing ``TAG`` is first moved aside to
``TAG.replaced-*`` and deleted after), fsyncs the directory, and only then replaces ``latest``.
A crash at any point before that last rename leaves ``latest`` naming the previous complete
checkpoint; between the two renames of a replaced tag, loading finds the moved-aside copy.

Note [loading]: every rank reads only the pieces its records need (reshard.plan_reads), from
whichever saved files hold them, after checking those files' sizes and checksums. Per-element
optimizer state (Adam's exp_avg / exp_avg_sq) is re-partitioned like the masters; scalar state
(Adam's ``step``) is taken as saved. Masters are then published into the model and replicated
units (stages 1-2) refreshed with the usual all-gather, so the model holds exactly the values
an update would have left.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import torch

import zerorun
from zerorun.errors import CheckpointError, RuntimeConfigError
from zerorun.zero.comm import collectives
from zerorun.zero.offload.placements import OnFile
from zerorun.zero.checkpoint.format import (ENGINE_FILE, FORMAT, FORMAT_VERSION, LATEST, MANIFEST, Reader,
                                           master_index, model_table, persistent_buffers, rank_file, read_manifest,
                                           resolve)
from zerorun.zero.checkpoint.reshard import (BUFFER, FROZEN, MASTER, RNG, Uncovered, bad_tag, first_mismatch, index_pieces,
                                  micro_steps_after_load, piece_key, plan_reads, state_family, step_tag,
                                  tags_to_delete, whole_key)
from zerorun.zero.unit.layout import Segment
from zerorun.zero.checkpoint.tensor_files import DTYPE_NAMES, DTYPES, TensorFileWriter, fsync_dir, write_bytes_atomically
from zerorun.zero.unit.storage import ParamState

# -- scalars as JSON ------------------------------------------------------------------------
def _encode_scalar(value):
    if torch.is_tensor(value):
        return {"tensor": value.item(), "dtype": DTYPE_NAMES[value.dtype]}
    json.dumps(value)  # raises TypeError for what JSON cannot hold
    return {"value": value}


def _decode_scalar(entry, device: torch.device):
    if "tensor" in entry:
        return torch.tensor(entry["tensor"], dtype=DTYPES[entry["dtype"]], device=device)
    value = entry["value"]
    return tuple(value) if isinstance(value, list) else value


def _python_rng() -> dict:
    state = {"python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, keys.tolist(), position, has_gauss, cached]
    return json.loads(json.dumps(state))


def _restore_python_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        name, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))


def _torch_rng() -> dict[str, torch.Tensor]:
    states = {whole_key(RNG, "torch"): torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            states[whole_key(RNG, f"cuda{index}")] = state
    return states


# -- save -----------------------------------------------------------------------------------
def _writes_records(engine) -> bool:
    """Note [what a rank writes]: unsharded chunks (stage 0, world 1) are written by rank 0 only."""
    return engine.stage != 0 or engine.rank == 0


def _state_split(record, optimizer) -> tuple[dict[str, torch.dtype], dict]:
    """A record's optimizer state: per-element tensors (key -> dtype) and scalars (key -> value).
    Between NVMe updates a per-element tensor is an empty placeholder (offload/placements.py Note [file
    buffers]), recognised by its zero size."""
    n = record.unit.layout.chunk_numel
    elementwise, scalars = {}, {}
    for key, value in optimizer.state.get(record.master, {}).items():
        if torch.is_tensor(value) and (value.numel() == n or (value.numel() == 0 and isinstance(record.placement, OnFile))):
            elementwise[key] = value.dtype
        else:
            scalars[key] = value
    return elementwise, scalars


def _rank_entries(engine) -> tuple[list, dict]:
    """(key, dtype, shape) of everything this rank writes, and the scalars of its names."""
    entries, scalars = [], {}
    if _writes_records(engine):
        for record in engine.records:
            elementwise, record_scalars = _state_split(record, engine.optimizer)
            for seg in record.segments:
                entries.append((piece_key(MASTER, seg.name, seg.param_offset, seg.length), torch.float32, (seg.length,)))
                for key, dtype in elementwise.items():
                    entries.append((piece_key(state_family(key), seg.name, seg.param_offset, seg.length), dtype, (seg.length,)))
                if record_scalars:
                    scalars[seg.name] = {k: _encode_scalar(v) for k, v in record_scalars.items()}
    if engine.rank == 0:
        for name, tensor in _frozen_and_buffers(engine):
            entries.append((name, tensor.dtype, tuple(tensor.shape)))
    for key, state in _torch_rng().items():
        entries.append((key, state.dtype, tuple(state.shape)))
    return entries, scalars


def _frozen_and_buffers(engine) -> list[tuple[str, torch.Tensor]]:
    frozen = [(whole_key(FROZEN, n), p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    return frozen + [(whole_key(BUFFER, n), b) for n, b in persistent_buffers(engine.module)]


def _write_rank_file(engine, staging: Path) -> dict:
    entries, scalars = _rank_entries(engine)
    path = staging / rank_file(engine.rank)
    try:
        writer = TensorFileWriter(path, entries, metadata={"format": "pt"})
    except OSError as exc:
        raise CheckpointError(f"cannot write {str(path)!r} ({exc.strerror})",
                              hint="checkpoint.dir must be a writable directory shared by every rank") from None
    try:
        if _writes_records(engine):
            for record in engine.records:
                _write_record(writer, record, engine.optimizer)
        if engine.rank == 0:
            for key, tensor in _frozen_and_buffers(engine):
                writer.write(key, tensor)
        for key, state in _torch_rng().items():
            writer.write(key, state)
        checksum = writer.commit()
    except BaseException:
        writer.abandon()
        raise
    finally:
        if isinstance(engine.updater.placement, OnFile):
            engine.updater.placement.flush()
    return {"file": rank_file(engine.rank), "keys": [key for key, _, _ in entries], "scalars": scalars,
            "rng": _python_rng(), "checksum": checksum}


def _write_record(writer: TensorFileWriter, record, optimizer) -> None:
    elementwise, _ = _state_split(record, optimizer)
    record.placement.begin_update(record, optimizer)  # NVMe: read master and state in
    try:
        state = optimizer.state.get(record.master, {})
        for seg in record.segments:
            span = slice(seg.shard_offset, seg.shard_offset + seg.length)
            writer.write(piece_key(MASTER, seg.name, seg.param_offset, seg.length), record.master[span])
            for key in elementwise:
                writer.write(piece_key(state_family(key), seg.name, seg.param_offset, seg.length), state[key][span])
    finally:
        record.placement.end_update(record, optimizer)


def _engine_state(engine, client_state) -> dict:
    scheduler = engine.lr_scheduler
    return {
        "global_step": engine.global_step, "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps, "gradient_accumulation_steps": engine.gradient_accumulation_steps,
        "loss_scaler": dataclasses.asdict(engine.loss_scaler),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
        "client_state": client_state,
    }


def save_checkpoint(engine, save_dir, tag: str | None = None, client_state=None, *, save_latest: bool = True,
                    keep_last: int | None = None) -> bool:
    """Write a checkpoint of ``engine`` under ``save_dir/tag`` (every rank must call this)."""
    started = time.perf_counter()
    tag = str(tag) if tag is not None else step_tag(engine.global_step)
    problem = bad_tag(tag)
    if problem:
        raise CheckpointError(f"checkpoint tag {tag!r} cannot be used: {problem}")
    if engine.micro_steps % engine.gradient_accumulation_steps:
        raise CheckpointError(
            f"save_checkpoint was called in the middle of a gradient accumulation window (micro-step "
            f"{engine.micro_steps % engine.gradient_accumulation_steps} of {engine.gradient_accumulation_steps}); "
            "the gradients accumulated so far are not saved",
            hint="save right after the engine.step() that ends a window (engine.is_gradient_accumulation_boundary())")
    root = Path(save_dir)
    staging = root / f"{tag}.partial"
    if engine.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # what a crashed save of this tag left
            staging.mkdir()
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoints to {str(root)!r} ({exc.strerror})",
                                  hint="checkpoint.dir must be a writable directory shared by every rank") from None
    collectives.barrier(group=engine.group)
    table = model_table(engine.module)
    entry = _write_rank_file(engine, staging)
    write_bytes_atomically(staging / f"rank{engine.rank}.json", json.dumps(entry).encode())
    if engine.rank == 0:
        buffer = io.BytesIO()
        torch.save(_engine_state(engine, client_state), buffer)
        engine_checksum = write_bytes_atomically(staging / ENGINE_FILE, buffer.getvalue())
    collectives.barrier(group=engine.group)
    if engine.rank == 0:
        manifest = _manifest(engine, tag, table, staging, engine_checksum)
        final = _commit(root, staging, tag, manifest, save_latest)
        if keep_last:
            _delete_old(root, keep_last, tag)
        total = sum(f["bytes"] for f in manifest["files"].values())
        print(f"zerorun: checkpoint {tag} saved to {final} in {time.perf_counter() - started:.2f} s "
              f"({total / 2**20:.1f} MiB from {engine.world_size} rank(s))", file=sys.stderr, flush=True)
    collectives.barrier(group=engine.group)
    return True


def _manifest(engine, tag: str, table: dict, staging: Path, engine_checksum: dict) -> dict:
    ranks, files = [], {}
    for rank in range(engine.world_size):
        path = staging / f"rank{rank}.json"
        entry = json.loads(path.read_text())
        files[entry.pop("file")] = entry.pop("checksum")
        ranks.append(entry)
    files[ENGINE_FILE] = engine_checksum
    cfg = engine.config
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tag": tag, "global_step": engine.global_step,
        "world_size": engine.world_size, "stage": engine.stage, "dtype": DTYPE_NAMES[engine.dtype],
        "offload_optimizer": cfg.zero.offload_optimizer.device, "optimizer": type(engine.optimizer).__name__,
        "versions": {"zerorun": zerorun.__version__, "torch": torch.__version__, "python": platform.python_version()},
        **table, "files": files, "ranks": ranks,
    }


def _commit(root: Path, staging: Path, tag: str, manifest: dict, save_latest: bool) -> Path:
    """Note [commit order]."""
    write_bytes_atomically(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
    for rank in range(manifest["world_size"]):
        (staging / f"rank{rank}.json").unlink()
    fsync_dir(staging)
    final = root / tag
    aside = None
    if final.exists():
        aside = root / f"{tag}.replaced-{os.getpid()}-{time.time_ns()}"
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_dir(root)
    if save_latest:
        write_bytes_atomically(root / LATEST, tag.encode())
        fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def _delete_old(root: Path, keep_last: int, just_saved: str) -> None:
    complete = [p.name for p in root.iterdir() if (p / MANIFEST).is_file()]
    for tag in tags_to_delete(complete, keep_last, just_saved):
        shutil.rmtree(root / tag, ignore_errors=True)
        shutil.rmtree(root / f"{tag}.partial", ignore_errors=True)


# -- load -----------------------------------------------------------------------------------
def _check_fits(engine, manifest: dict, directory: Path) -> None:
    table = model_table(engine.module)
    shapes = lambda section: {n: i["shape"] for n, i in section.items()}  # noqa: E731
    problem = (first_mismatch(shapes(manifest["parameters"]), shapes(table["parameters"]))
               or first_mismatch(shapes(manifest["buffers"]), shapes(table["buffers"]), what="buffer"))
    if problem:
        raise CheckpointError(f"checkpoint {str(directory)!r} does not fit this model: {problem}",
                              hint="load it into the model it was saved from (same names and shapes)")


def load_checkpoint(engine, load_dir, tag: str | None = None, *, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Load into ``engine`` (every rank): returns (checkpoint path, client state), or
    (None, None) when ``load_dir`` holds no checkpoint yet (as DeepSpeed does)."""
    directory = resolve(load_dir, tag)
    if directory is None:
        if engine.rank == 0:
            print(f"zerorun: no checkpoint in {str(load_dir)!r} yet (no {LATEST} file); nothing loaded",
                  file=sys.stderr, flush=True)
        return None, None
    manifest = read_manifest(directory)
    _check_fits(engine, manifest, directory)
    reader = Reader(directory, manifest)
    try:
        _load_records(engine, reader, manifest, optimizer_states=load_optimizer_states and not load_module_only)
        _load_frozen_and_buffers(engine, reader, manifest)
        client_state = None
        if not load_module_only:
            client_state = _load_engine_state(engine, reader, load_lr_scheduler_states)
            if engine.rank < manifest["world_size"]:
                _load_rng(reader, manifest, engine.rank)
    finally:
        reader.close()
    return str(directory), client_state


def _load_frozen_and_buffers(engine, reader: Reader, manifest: dict) -> None:
    """Whole tensors from rank 0's file; a parameter frozen now but trainable when saved is
    assembled from its master pieces."""
    index = None
    with torch.no_grad():
        for key, tensor in _frozen_and_buffers(engine):
            name = key.split("/", 1)[1]
            if key.startswith(FROZEN) and manifest["parameters"][name]["trainable"]:
                index = index or master_index(manifest)[0]
                whole = torch.empty(tensor.numel(), dtype=torch.float32)
                reader.fill(plan_reads([Segment(name, 0, 0, tensor.numel())], index), whole)
                tensor.copy_(whole.view(tensor.shape))
            else:
                tensor.copy_(reader.file(rank_file(0)).read(key))


def _load_records(engine, reader: Reader, manifest: dict, *, optimizer_states: bool) -> None:
    index, files = master_index(manifest)
    families = sorted({key.split("/", 1)[0] for keys in files.values() for key in keys if key.startswith("state.")})
    state_index = {family: index_pieces(files, family) for family in families}
    scalars: dict[str, dict] = {}
    for entry in manifest["ranks"]:
        scalars.update(entry["scalars"])
    if engine.gatherer is not None:
        engine.gatherer.release_all()  # a unit left gathered would keep stale values
    optimizer = engine.optimizer
    for record in engine.records:
        try:
            master_reads = plan_reads(record.segments, index)
        except Uncovered as gap:
            raise CheckpointError(f"checkpoint {str(reader.directory)!r} has no saved values for parameter "
                                  f"{gap.name!r} (elements {gap.start}-{gap.end})", hint="it is incomplete or from another model") from None
        record.placement.begin_update(record, optimizer)
        try:
            with torch.no_grad():
                reader.fill(master_reads, record.master)
            if optimizer_states:
                optimizer.state[record.master] = _record_state(record, reader, state_index, scalars, optimizer)
            with torch.no_grad():
                record.placement.publish(record)
        finally:
            record.placement.end_update(record, optimizer)
    if isinstance(engine.updater.placement, OnFile):
        engine.updater.placement.flush()
    handles = [r.unit.start_refresh(engine.group) for r in engine.records if r.unit.state is ParamState.REPLICATED]
    for handle in handles:
        handle.wait()


def _record_state(record, reader: Reader, state_index: dict, scalars: dict, optimizer) -> dict:
    """The optimizer state of one record, re-partitioned from the saved pieces."""
    state = {}
    names = [seg.name for seg in record.segments]
    for family, index in state_index.items():
        present = [name for name in names if name in index]
        if not present:
            continue
        if len(present) != len(names):
            raise CheckpointError(f"checkpoint {str(reader.directory)!r} has {family[6:]!r} optimizer state for "
                                  f"{present[0]!r} but not for {sorted(set(names) - set(present))[0]!r}",
                                  hint="pass load_optimizer_states=False to load the weights only")
        try:
            reads = plan_reads(record.segments, index)
        except Uncovered as gap:
            raise CheckpointError(f"checkpoint {str(reader.directory)!r} lacks {family[6:]!r} optimizer state "
                                  f"for parameter {gap.name!r}") from None
        dtype = reader.file(reads[0].file).info(reads[0].key)[0] if reads else torch.float32
        tensor = torch.zeros(record.master.numel(), dtype=dtype, device=record.master.device)
        with torch.no_grad():
            reader.fill(reads, tensor)
        state[family[len("state."):]] = tensor
    if names and names[0] in scalars:
        group = optimizer.param_groups[record.group_index]
        device = record.master.device if (group.get("fused") or group.get("capturable")) else torch.device("cpu")
        for key, entry in scalars[names[0]].items():
            state[key] = _decode_scalar(entry, device)
    return state


def _load_engine_state(engine, reader: Reader, load_scheduler: bool):
    path = reader.check(ENGINE_FILE)
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler's refusals are many types
        raise CheckpointError(f"checkpoint file {str(reader.directory / ENGINE_FILE)!r} cannot be loaded ({exc})") from None
    if len(saved["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this one "
                              f"{len(engine.optimizer.param_groups)}", hint="build the optimizer with the same groups")
    for group, hyper in zip(engine.optimizer.param_groups, saved["param_groups"]):
        group.update(hyper)
    engine.global_step = saved["global_step"]
    engine.skipped_steps = saved["skipped_steps"]
    engine.micro_steps = micro_steps_after_load(saved["micro_steps"], saved["gradient_accumulation_steps"],
                                                saved["global_step"], engine.gradient_accumulation_steps)
    for key, value in saved["loss_scaler"].items():
        setattr(engine.loss_scaler, key, value)
    if load_scheduler and engine.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    return saved["client_state"]


def _load_rng(reader: Reader, manifest: dict, rank: int) -> None:
    source = reader.file(rank_file(rank))
    torch.set_rng_state(source.read(whole_key(RNG, "torch")))
    cuda = [k for k in source.keys() if k.startswith(f"{RNG}/cuda")]
    if cuda and torch.cuda.is_available():
        states = [source.read(whole_key(RNG, f"cuda{i}")) for i in range(len(cuda))]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    _restore_python_rng(manifest["ranks"][rank]["rng"])


# -- the config's checkpoint section --------------------------------------------------------
def resume_from_config(engine) -> None:
    """``checkpoint.resume``: load the latest checkpoint of ``checkpoint.dir`` when there is one."""
    cfg = engine.config.checkpoint
    if not getattr(cfg, "resume", False):
        return
    if not cfg.dir:
        raise RuntimeConfigError("checkpoint.resume is set but checkpoint.dir is not", hint="set checkpoint.dir")
    from zerorun.config import load_config

    # initialize() settles the accumulation steps with the world size only after __init__.
    engine.gradient_accumulation_steps = load_config(engine.config, world_size=engine.world_size).gradient_accumulation_steps
    path, _ = load_checkpoint(engine, cfg.dir)
    if path is not None and engine.rank == 0:
        print(f"zerorun: resumed from {path} at step {engine.global_step}", file=sys.stderr, flush=True)


def save_on_interval(engine) -> None:
    """``checkpoint.interval_steps``: save after every N-th optimizer step, keeping ``keep_last``;
    ``checkpoint.on_signal``: save and stop when the launcher passed on Slurm's signal."""
    from zerorun.launch import save_on_signal

    cfg = engine.config.checkpoint
    saved = cfg.interval_steps > 0 and cfg.dir and engine.global_step % cfg.interval_steps == 0
    if saved:
        save_checkpoint(engine, cfg.dir, keep_last=cfg.keep_last)
    if cfg.on_signal and cfg.dir and save_on_signal.due(engine):
        if not saved:
            save_checkpoint(engine, cfg.dir, keep_last=cfg.keep_last)
        save_on_signal.stop(engine, cfg.dir)


# -- the whole model ------------------------------------------------------------------------
def full_state_dict(engine, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict, gathered one stage-3 unit at a time (every rank must call it):
    at most one gathered unit is alive beside the copies rank 0 keeps."""
    keep = not rank0_only or engine.rank == 0
    unit_of = {id(p): u for u in engine.partition.units if u.partitioned for p in u.params}
    pool = engine.gatherer.pool if engine.gatherer is not None else None
    state: dict[str, torch.Tensor] = {}
    current, gathered_here = None, False

    def let_go():
        if current is not None and gathered_here:
            current.release()
            if pool is not None:
                pool.clear()

    try:
        for key, tensor in engine.module.state_dict(keep_vars=True).items():
            unit = unit_of.get(id(tensor))
            if unit is not None and unit is not current:
                let_go()
                current, gathered_here = unit, unit.state is ParamState.SHARDED
                unit.gather(engine.group)
            if keep:
                state[key] = tensor.detach().clone().cpu()
    finally:
        let_go()
    return state
