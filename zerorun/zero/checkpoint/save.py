"""Save an engine as a sharded, atomic, exactly resumable checkpoint.

``pytest tests/distributed/test_checkpoint_resume.py tests/distributed/test_checkpoint_crash.py tests/unit/test_checkpoint_safety.py`` runs its tests; the engine calls it:

    engine.save_checkpoint(dir, tag=None, client_state=None)        # every rank

Loading it back (any world size, any stage) is checkpoint/load.py; the ranks agree on every
step's success through checkpoint/agreement.py. One checkpoint is a directory (file names and
reading: checkpoint/format.py; the pieces' keys and the re-partitioning math: checkpoint/reshard.py;
the streamed safetensors files: checkpoint/tensor_files.py):

    DIR/latest                   the newest complete tag; moved last (Note [commit order])
    DIR/TAG/manifest.json        layout, world size, stage, versions, a checksum per file, and per
                                 rank: its tensor keys, RNG states and scalar optimizer state
    DIR/TAG/rank{R}.safetensors  rank R's pieces (checkpoint/reshard.py): fp32 masters and per-element
                                 optimizer state by (parameter name, element range); R's torch
                                 RNG states (checkpoint/rng.py); rank 0 also each frozen parameter
                                 and buffer, whole
    DIR/TAG/engine.pt            counters, accumulation position, loss scaler, LR scheduler,
                                 param-group hyper-parameters, the user's client state (rank 0)

The engine surface used here and in checkpoint/load.py: ``records`` (save and load are loops over
them), ``quiesce()``, ``train_state`` (zero/train_state.py), ``module``, ``pg`` (rank, world size,
group), ``config``.

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
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

import zerorun
from zerorun.errors import CheckpointError
from zerorun.worker import preemption_grace
from zerorun.telemetry import get_recorder
from zerorun.zero import full_state
from zerorun.zero.checkpoint import owner
from zerorun.zero.checkpoint.agreement import together
from zerorun.zero.checkpoint.client_state import check_client_state
from zerorun.zero.checkpoint.hf_output import peft_configs
from zerorun.zero.checkpoint.format import (ENGINE_FILE, FORMAT, FORMAT_VERSION, LATEST, MANIFEST, encode_scalar,
                                           frozen_and_buffers, manifest_checksum, model_table, rank_file, resolve)
from zerorun.zero.checkpoint.reshard import MASTER, bad_tag, piece_key, state_family, step_tag, tags_to_delete
from zerorun.zero.checkpoint.rng import python_rng, torch_rng
from zerorun.zero.checkpoint.tensor_files import DTYPE_NAMES, TensorFileWriter, fsync_dir, write_bytes_atomically
from zerorun.zero.offload.scratch import job_key
from zerorun.zero.precision import model_dtype


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
                    scalars[seg.name] = {k: encode_scalar(v) for k, v in record_scalars.items()}
    if engine.pg.rank == 0:
        for name, tensor in frozen_and_buffers(engine):
            entries.append((name, tensor.dtype, tuple(tensor.shape)))
    for key, state in torch_rng().items():
        entries.append((key, state.dtype, tuple(state.shape)))
    return entries, scalars


def _write_rank_file(engine, staging: Path, frozen: dict[str, torch.Tensor]) -> dict:
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
            for key, tensor in frozen_and_buffers(engine):
                writer.write(key, frozen.get(key, tensor))
        for key, state in torch_rng().items():
            writer.write(key, state)
        checksum = writer.commit()
    except BaseException:
        writer.abandon()
        raise
    finally:
        engine.quiesce()
    groups = {seg.name: record.unit.group_index for record in engine.records for seg in record.segments}
    return {"file": rank_file(engine.pg.rank), "keys": [key for key, _, _ in entries], "scalars": scalars,
            "rng": python_rng(), "checksum": checksum, "groups": groups}


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
    after = _after_a_failure(root)
    try:
        together(engine, lambda: _prepare(engine, root, staging), f"preparing checkpoint {tag}", hint=after)
        table = model_table(engine.module)
        # Stage 3 partitions frozen parameters (Note [frozen units] in zero/unit/partition.py) and
        # rank 0's file holds them whole: every rank gathers their units in turn here, where
        # every rank arrives, and rank 0 keeps host copies to write; inside ``write`` a gather
        # would be a collective that a rank failing its own writes never joins.
        frozen = full_state.host_copies(engine, frozen_and_buffers(engine), keep=engine.pg.rank == 0)

        def write() -> None:
            entry = _write_rank_file(engine, staging, frozen)
            write_bytes_atomically(staging / f"rank{engine.pg.rank}.json", json.dumps(entry).encode())
            if engine.pg.rank == 0:
                buffer = io.BytesIO()
                torch.save(engine.train_state.state_dict() | {"client_state": client_state}, buffer)
                written["engine"] = write_bytes_atomically(staging / ENGINE_FILE, buffer.getvalue())

        written: dict = {}
        together(engine, write, f"writing checkpoint {tag}", hint=after)

        def commit() -> None:
            manifest = _manifest(engine, tag, table, staging, written["engine"])
            final = _commit(root, staging, tag, manifest, save_latest)
            if keep_last:
                _delete_old(root, keep_last, tag)
            _delete_leftovers(root)
            total = sum(f["bytes"] for f in manifest["files"].values())
            took = time.perf_counter() - started
            print(f"zerorun: checkpoint {tag} saved to {final} in {took:.2f} s "
                  f"({total / 2**20:.1f} MiB from {engine.pg.world_size} rank(s))", file=sys.stderr, flush=True)
            slow = preemption_grace.note_save_time(took)  # Note [preemption grace]
            if slow:
                print(slow, file=sys.stderr, flush=True)

        together(engine, commit if engine.pg.rank == 0 else None, f"committing checkpoint {tag}", hint=after)
    finally:
        recorder.record_activity(None, 0)
    return True


def _after_a_failure(root: Path) -> str:
    """What a failed save leaves, for its hint: "the previous checkpoint is intact" only when
    there is one (it used to be said of a directory that held none)."""
    try:
        previous = resolve(root) if root.is_dir() else None
    except (CheckpointError, OSError):
        previous = None
    if previous is None:
        return "no checkpoint of this directory existed before this save, and none was written"
    return f"the previous checkpoint ({previous.name}) is intact"


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
    adapters = peft_configs(engine.module)  # Note [names that fit] (checkpoint/hf_output.py)
    if adapters is not None:
        manifest["peft"] = adapters
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


