"""Sharded, atomic, exactly resumable checkpoints of an engine.

``pytest tests/distributed/test_checkpoint_resume.py tests/distributed/test_checkpoint_reshard.py`` runs its tests; the engine calls it:

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

The engine surface used here: ``records`` (save and load are loops over them), ``quiesce()``,
``train_state`` (zero/train_state.py), ``module``, ``pg`` (rank, world size, group), ``config``.

Note [what a rank writes]: each rank writes the pieces of its own chunks (``record.segments``),
read from the record's master and ``optimizer.state[record.master]``, so no collective moves
any tensor and every element is written exactly once: at stage 0 (and at world size 1) the
chunk is the whole unit on every rank, and only rank 0 writes it. The model-dtype parameters
are not written: after every update they are the masters rounded to the model dtype, which is
what loading and consolidating recompute. Offloaded state is read where it lives, inside the
state home's ``resident(record)`` context (NVMe: one unit's buffer at a time, as an update would).

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
from zerorun.worker.device import storage_home
from zerorun.errors import CheckpointError, ZerorunError
from zerorun.zero.comm import collectives
from zerorun.zero.checkpoint import owner
from zerorun.zero.checkpoint.client_state import check_client_state
from zerorun.zero.checkpoint.format import (ENGINE_FILE, FORMAT, FORMAT_VERSION, LATEST, MANIFEST, Reader,
                                           manifest_checksum, master_index, model_table, persistent_buffers, rank_file,
                                           read_manifest, resolve)
from zerorun.zero.offload.scratch import job_key
from zerorun.telemetry import get_recorder
from zerorun.zero.checkpoint.reshard import (BUFFER, FROZEN, MASTER, RNG, Uncovered, bad_tag, first_mismatch, index_pieces,
                                  piece_key, plan_reads, state_family, step_tag,
                                  tags_to_delete, whole_key)
from zerorun.zero.unit.layout import Segment
from zerorun.zero.precision import model_dtype
from zerorun.zero.checkpoint.tensor_files import (DTYPE_NAMES, DTYPES, TensorFileWriter, fsync_dir, load_refusal,
                                                  write_bytes_atomically)
from zerorun.zero.unit.storage import ParamState
from zerorun.zero.update import refresh_replicas

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
    state: dict[str, object] = {"python": random.getstate()}
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
    return engine.config.zero.stage != 0 or engine.pg.rank == 0


def _state_split(record, optimizer) -> tuple[dict[str, torch.dtype], dict]:
    """A record's optimizer state: per-element tensors (key -> dtype) and scalars (key -> value).
    Between NVMe updates a per-element tensor is a placeholder of its size (offload/nvme.py
    Note [file buffers]), so the split needs no read."""
    n = record.unit.layout.chunk_numel
    elementwise, scalars = {}, {}
    for key, value in optimizer.state.get(record.master, {}).items():
        if torch.is_tensor(value) and value.numel() == n:
            elementwise[key] = value.dtype
        else:
            scalars[key] = value
    return elementwise, scalars


def _rank_entries(engine) -> tuple[list, dict]:
    """(key, dtype, shape) of everything this rank writes, and the scalars of its names."""
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    scalars: dict[str, dict] = {}
    if _writes_records(engine):
        for record in engine.records:
            elementwise, record_scalars = _state_split(record, engine.train_state.optimizer)
            for seg in record.segments:
                entries.append((piece_key(MASTER, seg.name, seg.param_offset, seg.length), torch.float32, (seg.length,)))
                for key, dtype in elementwise.items():
                    entries.append((piece_key(state_family(key), seg.name, seg.param_offset, seg.length), dtype, (seg.length,)))
                if record_scalars:
                    scalars[seg.name] = {k: _encode_scalar(v) for k, v in record_scalars.items()}
    if engine.pg.rank == 0:
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
    path = staging / rank_file(engine.pg.rank)
    try:
        writer = TensorFileWriter(path, entries, metadata={"format": "pt"})
    except OSError as exc:
        raise CheckpointError(f"cannot write {str(path)!r} ({exc.strerror})",
                              hint="checkpoint.dir must be a writable directory shared by every rank") from None
    try:
        if _writes_records(engine):
            for record in engine.records:
                _write_record(writer, record, engine.train_state.optimizer)
        if engine.pg.rank == 0:
            for key, tensor in _frozen_and_buffers(engine):
                writer.write(key, tensor)
        for key, state in _torch_rng().items():
            writer.write(key, state)
        checksum = writer.commit()
    except BaseException:
        writer.abandon()
        raise
    finally:
        engine.quiesce()
    groups = {seg.name: record.unit.group_index for record in engine.records for seg in record.segments}
    return {"file": rank_file(engine.pg.rank), "keys": [key for key, _, _ in entries], "scalars": scalars,
            "rng": _python_rng(), "checksum": checksum, "groups": groups}


def _write_record(writer: TensorFileWriter, record, optimizer) -> None:
    elementwise, _ = _state_split(record, optimizer)
    with record.state_home.resident(record, optimizer):  # NVMe: read master and state in
        state = optimizer.state.get(record.master, {})
        for seg in record.segments:
            span = slice(seg.shard_offset, seg.shard_offset + seg.length)
            writer.write(piece_key(MASTER, seg.name, seg.param_offset, seg.length), record.master[span])
            for key in elementwise:
                writer.write(piece_key(state_family(key), seg.name, seg.param_offset, seg.length), state[key][span])
        get_recorder().record_activity("saving", writer.nbytes)  # Note [saving is progress]


def save_checkpoint(engine, save_dir, tag: str | None = None, client_state=None, *, save_latest: bool = True,
                    keep_last: int | None = None) -> bool:
    """Write a checkpoint of ``engine`` under ``save_dir/tag`` (every rank must call this)."""
    started = time.perf_counter()
    train = engine.train_state
    tag = str(tag) if tag is not None else step_tag(train.global_step)
    problem = bad_tag(tag)
    if problem:
        raise CheckpointError(f"checkpoint tag {tag!r} cannot be used: {problem}")
    if train.micro_steps % train.gradient_accumulation_steps:
        raise CheckpointError(
            f"save_checkpoint was called in the middle of a gradient accumulation window (micro-step "
            f"{train.micro_steps % train.gradient_accumulation_steps} of {train.gradient_accumulation_steps}); "
            "the gradients accumulated so far are not saved",
            hint="save right after the engine.step() that ends a window (engine.is_gradient_accumulation_boundary())")
    check_client_state(client_state)
    root = Path(save_dir)
    staging = root / f"{tag}.partial"
    recorder = get_recorder()
    recorder.record_activity("saving", 0)
    try:
        _together(engine, lambda: _prepare(engine, root, staging), f"preparing checkpoint {tag}")
        table = model_table(engine.module)

        def write() -> None:
            entry = _write_rank_file(engine, staging)
            write_bytes_atomically(staging / f"rank{engine.pg.rank}.json", json.dumps(entry).encode())
            if engine.pg.rank == 0:
                buffer = io.BytesIO()
                torch.save(engine.train_state.state_dict() | {"client_state": client_state}, buffer)
                written["engine"] = write_bytes_atomically(staging / ENGINE_FILE, buffer.getvalue())

        written: dict = {}
        _together(engine, write, f"writing checkpoint {tag}")

        def commit() -> None:
            manifest = _manifest(engine, tag, table, staging, written["engine"])
            final = _commit(root, staging, tag, manifest, save_latest)
            if keep_last:
                _delete_old(root, keep_last, tag)
            _delete_leftovers(root)
            total = sum(f["bytes"] for f in manifest["files"].values())
            print(f"zerorun: checkpoint {tag} saved to {final} in {time.perf_counter() - started:.2f} s "
                  f"({total / 2**20:.1f} MiB from {engine.pg.world_size} rank(s))", file=sys.stderr, flush=True)

        _together(engine, commit if engine.pg.rank == 0 else None, f"committing checkpoint {tag}")
    finally:
        recorder.record_activity(None, 0)
    return True


def _prepare(engine, root: Path, staging: Path) -> None:
    """Rank 0: own the directory (Note [checkpoint owner] in checkpoint/owner.py), then a clean
    ``TAG.partial``."""
    if engine.pg.rank != 0:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {str(root)!r} ({exc.strerror})",
                              hint="checkpoint.dir must be a writable directory shared by every rank") from None
    owner.claim(root, job_key())
    try:
        # What a crashed save of this tag left; ``TAG.partial`` is zerorun's own name, so a file
        # or symlink planted there is removed (never followed) rather than failing the save.
        if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
            staging.unlink()
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as exc:
        raise CheckpointError(f"cannot create {str(staging)!r} ({exc.strerror})",
                              hint="checkpoint.dir must be a writable directory shared by every rank") from None


def _together(engine, work, what: str, hint: str = "the previous checkpoint is intact") -> None:
    """Note [failing together]: run ``work`` (None: nothing on this rank), then agree with every
    rank on whether all succeeded. A failure on one rank used to leave the others at the next
    barrier, to die of a misleading "connection closed" once it exited; now the rank that failed
    raises its own one-line error and every other rank one naming that rank."""
    failure = None
    try:
        if work is not None:
            work()
    except (ZerorunError, OSError) as exc:
        failure = exc
    if engine.pg.world_size > 1:
        flags = torch.zeros(engine.pg.world_size, dtype=torch.int32, device=engine.pg.device)
        flags[engine.pg.rank] = failure is not None
        collectives.all_reduce(flags, group=engine.pg.group)
        failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    else:
        failed = [0] if failure is not None else []
    if failure is not None:
        if isinstance(failure, OSError):
            raise CheckpointError(f"rank {engine.pg.rank}: {what} failed ({failure})") from None
        raise failure
    if failed:
        raise CheckpointError(f"rank {engine.pg.rank}: {what} failed on rank {failed[0]} (its error says why)", hint=hint)


def _manifest(engine, tag: str, table: dict, staging: Path, engine_checksum: dict) -> dict:
    ranks, files, groups = [], {}, {}
    for rank in range(engine.pg.world_size):
        path = staging / f"rank{rank}.json"
        entry = json.loads(path.read_text())
        files[entry.pop("file")] = entry.pop("checksum")
        groups.update(entry.pop("groups"))
        ranks.append(entry)
    files[ENGINE_FILE] = engine_checksum
    cfg = engine.config
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tag": tag, "global_step": engine.train_state.global_step,
        "world_size": engine.pg.world_size, "stage": engine.config.zero.stage,
        "dtype": DTYPE_NAMES[model_dtype(engine.config.precision)],
        "offload_optimizer": cfg.zero.offload_optimizer.device, "optimizer": type(engine.train_state.optimizer).__name__,
        "param_groups": len(engine.train_state.optimizer.param_groups), "group_of": groups,
        "versions": {"zerorun": zerorun.__version__, "torch": torch.__version__, "python": platform.python_version()},
        **table, "files": files, "ranks": ranks,
    }
    manifest["checksum"] = manifest_checksum(manifest)
    return manifest


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


def _delete_leftovers(root: Path) -> None:
    """After a successful save, with the directory owned (checkpoint/owner.py): what earlier
    failed saves left, ``TAG.partial`` folders and temporaries (``NAME.tmp-*``), and copies of
    replaced tags whose removal a crash interrupted, once their tag is complete again."""
    for path in root.iterdir():
        name = path.name
        if name.endswith(".partial") and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif ".tmp-" in name and (path.is_file() or path.is_symlink()):
            path.unlink(missing_ok=True)
        elif ".replaced-" in name and path.is_dir() and not path.is_symlink():
            if (root / name.split(".replaced-", 1)[0] / MANIFEST).is_file():
                shutil.rmtree(path, ignore_errors=True)


def _delete_old(root: Path, keep_last: int, just_saved: str) -> None:
    complete = [p.name for p in root.iterdir() if (p / MANIFEST).is_file()]
    for tag in tags_to_delete(complete, keep_last, just_saved):
        shutil.rmtree(root / tag, ignore_errors=True)
        shutil.rmtree(root / f"{tag}.partial", ignore_errors=True)


# -- load -----------------------------------------------------------------------------------
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

    try:
        # Every rank checks, then all agree (Note [failing together]): a file damaged for one
        # rank refuses the load on all, before any of them changed its engine.
        _together(engine, check, f"checking checkpoint {str(load_dir)!r}", hint="nothing was loaded on any rank")
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
                _load_rng(reader, manifest, engine.pg.rank)
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
    for key, tensor in _frozen_and_buffers(engine):
        names.add(rank_file(0))
        name = key.split("/", 1)[1]
        if key.startswith(FROZEN) and manifest["parameters"][name]["trainable"]:  # see _load_frozen_and_buffers
            index = index or master_index(manifest)[0]
            names |= {read.file for read in plan_reads([Segment(name, 0, 0, tensor.numel())], index)}
    if rng and engine.pg.rank < manifest["world_size"]:
        names.add(rank_file(engine.pg.rank))
    return sorted(names)


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
    refresh_replicas(engine.records, engine.pg.group)


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
            state[key] = _decode_scalar(entry, device)
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


def _load_rng(reader: Reader, manifest: dict, rank: int) -> None:
    source = reader.file(rank_file(rank))
    torch.set_rng_state(source.read(whole_key(RNG, "torch")))
    cuda = [k for k in source.keys() if k.startswith(f"{RNG}/cuda")]
    # Only where CUDA is already in use (a GPU worker moved its model there): asking
    # is_available() or device_count() in a CPU worker on a GPU node starts the CUDA driver,
    # which Note [device contract] (zerorun/worker/device.py) promises never happens.
    if cuda and torch.cuda.is_initialized():
        states = [source.read(whole_key(RNG, f"cuda{i}")) for i in range(len(cuda))]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    _restore_python_rng(manifest["ranks"][rank]["rng"])


# -- the whole model ------------------------------------------------------------------------
def full_state_dict(engine, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict, gathered one stage-3 unit at a time (every rank must call it):
    at most one gathered unit is alive beside the copies rank 0 keeps."""
    keep = not rank0_only or engine.pg.rank == 0
    unit_of = {id(p): r.unit for r in engine.records if r.unit.partitioned for p in r.unit.params}
    state: dict[str, torch.Tensor] = {}
    current, gathered_here = None, False

    def let_go():
        if current is not None and gathered_here:
            current.release()
            if current.pool is not None:  # Note [gather pool]: keep no unit's memory behind
                current.pool.clear()

    try:
        for key, tensor in engine.module.state_dict(keep_vars=True).items():
            unit = unit_of.get(id(tensor))
            if unit is not None and unit is not current:
                let_go()
                current, gathered_here = unit, unit.state is ParamState.SHARDED
                unit.gather(engine.pg.group)
            if keep:
                state[key] = tensor.detach().clone().cpu()
    finally:
        let_go()
    return state
