"""pytest tests/unit/test_sharding_runtime.py — engine pieces at world size 1 (no process group):
the loss scaler, config errors, the rebuilt optimizer and LR schedulers, state transitions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import zerorun
from zerorun.config import PrecisionConfig
from zerorun.errors import InternalError, RuntimeConfigError, ZerorunError
from zerorun.zero.precision import LossScaler
from zerorun.zero.unit.storage import FlatUnit, ParamState


def test_loss_scaler_halves_after_hysteresis_and_grows_after_a_clean_window():
    scaler = LossScaler.from_config(PrecisionConfig(dtype="fp16", initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    assert scaler.dynamic and scaler.scale == 16
    assert scaler.update(overflow=True) is False and scaler.scale == 16  # hysteresis absorbs one
    assert scaler.update(overflow=True) is False and scaler.scale == 8
    assert [scaler.update(False) for _ in range(3)] == [True] * 3
    assert scaler.scale == 16


def test_loss_scaler_respects_floor_and_static_scale():
    scaler = LossScaler.from_config(PrecisionConfig(dtype="fp16", initial_scale_power=1, hysteresis=1, min_loss_scale=1.0))
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 1.0
    static = LossScaler.from_config(PrecisionConfig(dtype="fp16", loss_scale=128.0))
    assert not static.dynamic and static.update(True) is False and static.scale == 128.0
    assert LossScaler.from_config(PrecisionConfig(dtype="bf16")).scale == 1.0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"zero": {"stage": 4}}, "zero.stage"),
        ({"zero": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_size": 10}}},
         "buffer_size=10 is smaller than one unit"),
        ({"zero": {"stage": 0}, "optimizer": {"type": "NoSuchOpt"}}, "NoSuchOpt"),
    ],
)
def test_bad_configs_raise_runtime_config_errors(config, message):
    model = _model()
    with pytest.raises(ZerorunError, match=message):
        zerorun.initialize(model, None if "optimizer" in config else torch.optim.SGD(model.parameters(), lr=0.1), config)


def test_missing_optimizer_and_foreign_parameters_are_reported():
    with pytest.raises(RuntimeConfigError, match="no optimizer"):
        zerorun.initialize(_model(), None, {})
    model = _model()
    with pytest.raises(RuntimeConfigError, match="not a parameter of the model"):
        zerorun.initialize(model, torch.optim.SGD(_model().parameters(), lr=0.1), {})
    model = _model()
    with pytest.raises(RuntimeConfigError, match="in no optimizer param group"):
        zerorun.initialize(model, torch.optim.SGD(model[0].parameters(), lr=0.1), {})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lr_scheduler_on_engine_optimizer_drives_the_update(stage):
    """A scheduler that zeroes the LR after one step must freeze the model from then on."""
    model = _model()
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                {"zero": {"stage": stage, "param_persistence_threshold": 0}})
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 if step == 0 else 0.0)
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    initial = engine.full_state_dict()["0.weight"].clone()
    snapshots = []
    for _ in range(3):
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        scheduler.step()
        snapshots.append(engine.full_state_dict()["0.weight"].clone())
    assert not torch.equal(snapshots[0], initial)  # the first step (lr 0.1) moved it
    assert torch.equal(snapshots[1], snapshots[2])
    assert engine.optimizer.param_groups[0]["lr"] == 0.0
    assert engine.global_step == 3


def test_config_optimizer_section_and_memory_breakdown_keys():
    engine = zerorun.initialize(_model(), None, {"zero": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert type(engine.optimizer) is torch.optim.AdamW
    breakdown = engine.memory_breakdown()
    device_keys = {"parameters", "gradients", "optimizer_state", "communication_buffers"}
    assert set(breakdown) == device_keys | {"total", "offloaded_host", "offloaded_nvme"}
    n = sum(p.numel() for p in engine.module.parameters())
    assert breakdown["parameters"] >= 4 * n and breakdown["total"] == sum(breakdown[k] for k in device_keys)
    assert breakdown["offloaded_host"] == breakdown["offloaded_nvme"] == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_scheduler_built_before_initialize_steers_the_update(stage):
    """The user's optimizer object is the one that steps: a LambdaLR built on it before
    initialize that drops the lr to 0 after two steps must stop the parameters moving."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < 2 else 0.0)
    engine = zerorun.initialize(model, optimizer, {"zero": {"stage": stage, "param_persistence_threshold": 0}})
    assert engine.optimizer is optimizer
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    snapshots = [engine.full_state_dict()["0.weight"].clone()]
    for _ in range(4):
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        scheduler.step()
        snapshots.append(engine.full_state_dict()["0.weight"].clone())
    assert not torch.equal(snapshots[0], snapshots[1]) and not torch.equal(snapshots[1], snapshots[2])
    assert torch.equal(snapshots[2], snapshots[3]) and torch.equal(snapshots[3], snapshots[4])


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_shards_live_only_from_backward_to_the_step(stage):
    """Note [lazy gradient shards]: stages 2-3 create their fp32 shard accumulators in backward
    and drop them after the update (no gradient state between steps). A step with no backward
    before it finds no shard and must treat the gradient as zero (plain SGD: nothing moves)."""
    model = _model()
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                {"zero": {"stage": stage, "param_persistence_threshold": 0}})
    psi = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    engine.backward(((engine(x) - y) ** 2).mean())
    assert engine.memory_breakdown()["gradients"] >= 4 * psi
    engine.step()
    assert engine.memory_breakdown()["gradients"] == 0
    before = engine.full_state_dict()
    engine.step()  # no backward in this window
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_partitioned_unit_state_transitions_are_checked():
    params = [nn.Parameter(torch.arange(6.0)), nn.Parameter(torch.ones(5))]
    unit = FlatUnit(0, 0, [("a", params[0]), ("b", params[1])], shard_world=1, shard_rank=0, partition_params=True)
    assert unit.state is ParamState.SHARDED and unit.full.untyped_storage().nbytes() == 0
    unit.gather(group=None)
    assert unit.state is ParamState.GATHERED and torch.equal(params[0].detach(), torch.arange(6.0))
    unit.release()
    assert unit.state is ParamState.SHARDED and unit.full.untyped_storage().nbytes() == 0
    with pytest.raises(InternalError):
        unit._move(ParamState.SHARDED)  # SHARDED -> SHARDED is not a transition


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2"}, "RANK is not"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR is not set"),
    ],
)
def test_broken_launcher_environment_is_reported(monkeypatch, env, message):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = _model()
    with pytest.raises(RuntimeConfigError, match=message):
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})


def test_config_path_from_environment(monkeypatch, tmp_path):
    path = tmp_path / "zr.yaml"
    path.write_text("zero:\n  stage: 2\n")
    monkeypatch.setenv("ZERORUN_CONFIG", str(path))
    model = _model()
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.stage == 2


def test_host_malloc_tuning_is_opt_in(monkeypatch):
    from zerorun.zero import host_memory

    monkeypatch.setattr(host_memory, "_applied", False)
    monkeypatch.delenv("ZERORUN_HOST_MALLOC_TUNING", raising=False)
    assert host_memory.return_large_frees_to_os() is False
    assert [host_memory.malloc_tuning_mib({"ZERORUN_HOST_MALLOC_TUNING": v}) for v in ("0", "1", "4", "32")] == [0, 1, 4, 32]
    for bad in ("yes", "-1", "33", "1.5"):
        with pytest.raises(RuntimeConfigError, match=r"^ZERORUN_HOST_MALLOC_TUNING is .* a threshold in MiB from 1 to 32"):
            host_memory.malloc_tuning_mib({"ZERORUN_HOST_MALLOC_TUNING": bad})


def test_pooled_unit_reuses_its_buffer_and_saved_views_see_the_new_gather():
    """Note [gather pool]: a release hands the memory to the pool, the next gather takes the
    same memory back into the unit's own storage object, so views taken earlier stay valid."""
    from zerorun.zero.unit.storage import GatherPool

    if not GatherPool.SUPPORTED:
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_; units resize instead")
    weight = nn.Parameter(torch.arange(6.0))
    unit = FlatUnit(0, 0, [("w", weight)], shard_world=1, shard_rank=0, partition_params=True)
    unit.pool = GatherPool()
    unit.gather(group=None)
    saved = weight.detach()[2:4]  # what autograd would have saved in forward
    address = unit.full.data_ptr()
    unit.release()
    assert unit.full.untyped_storage().nbytes() == 0 and unit.pool.nbytes() == unit.full_nbytes
    with torch.no_grad():
        unit.shard.add_(10.0)  # an optimizer step on the shard
    unit.gather(group=None)
    assert unit.full.data_ptr() == address and unit.pool.nbytes() == 0
    assert torch.equal(saved, torch.tensor([12.0, 13.0]))
    unit.release()
    unit.pool.clear()
    assert unit.pool.nbytes() == 0


def test_kept_units_plan_follows_reuse_distance_and_holds_the_last_call():
    from zerorun.zero.param_gather import plan_kept_units

    # calls: embedding(unit 0), block(1), block(2), head(0 again, tied)
    order = [[0], [1], [2], [0]]
    numel = {0: 100, 1: 10, 2: 10}
    keep_after, for_backward = plan_kept_units(order, numel, max_reuse_distance=20)
    assert keep_after == {0: {0}, 3: {0}} and for_backward == {0}
    keep_after, for_backward = plan_kept_units(order, numel, max_reuse_distance=19)
    assert keep_after == {3: {0}} and for_backward == {0}
    assert plan_kept_units([[], []], {}, 10) == ({}, set())


def test_stage3_gathers_a_tied_unit_once_per_step():
    """Note [kept gathered], at world size 1: the tied embedding/head unit is held from the
    embedding's forward to the head's, and from the head's forward into its backward."""
    from zerorun.zero.unit.storage import FlatUnit as Unit

    torch.manual_seed(0)
    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.body, self.head = emb, body, head

        def forward(self, tokens):
            return self.head(self.body(self.emb(tokens))).logsumexp(-1).mean()

    model = Tied()
    config = {"zero": {"stage": 3, "param_persistence_threshold": 0}}
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    tied = next(u for u in (r.unit for r in engine.records) if any(p is emb.weight for p in u.params))
    gathers = [0, 0, 0]
    original = Unit.start_gather

    def counting(self, group):
        if self is tied and self.state is ParamState.SHARDED:
            gathers[step] += 1
        original(self, group)

    Unit.start_gather = counting
    try:
        for step in range(3):  # noqa: B007 - counting() reads it
            engine.backward(engine(torch.randint(0, 50, (4, 5))))
            engine.step()
    finally:
        Unit.start_gather = original
    # The first forward records the order: embedding, head and head's backward each gather.
    assert gathers == [3, 1, 1]
    assert all(u.state is ParamState.SHARDED for u in (r.unit for r in engine.records) if u.partitioned)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class _Block(nn.Module):
    """A pre-norm block: its own unit (norm + attention stand-in) encloses its MLP's."""

    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(16), nn.Linear(16, 16), _MLP()

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def _nested_blocks_model():
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(3)], nn.Linear(16, 4))


def test_stage3_backward_finds_every_unit_prefetched_within_the_planned_bound():
    """Note [execution order]: a block's output hook fires before its MLP's, but the block's
    own parameters are read after the MLP's backward. Backward follows the reversed finishing
    order two modules ahead, so once the order is recorded no hook gathers synchronously, and
    what is gathered at once stays within the planner's bound (unit_plan.max_gathered_numel)."""
    from zerorun.planner.counting import count_module
    from zerorun.planner.memory import Training, stage3_unit_sizes
    from zerorun.zero.unit.storage import FlatUnit as Unit

    zero = {"stage": 3, "param_persistence_threshold": 0, "allgather_bucket_size": 1500}
    model = _nested_blocks_model()
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": zero})
    owners = {r.index for rs in engine.gatherer.module_records.values() for r in rs}
    assert len(owners) == 7  # three blocks, three MLPs, the head
    with torch.device("meta"):
        spec = count_module(_nested_blocks_model(), "blocks")
    bound = stage3_unit_sizes(spec, Training(stage=3, precision="fp32", param_persistence_threshold=0,
                                             allgather_bucket_size=1500))[0]
    in_backward, synchronous, most_gathered = [False], [], [0]
    original = Unit.gather

    def watching(self, group):
        if in_backward[0]:
            if self.state is ParamState.SHARDED:
                synchronous.append(self.index)
            alive = sum(u.layout.numel for u in (r.unit for r in engine.records)
                        if u.partitioned and u.state is not ParamState.SHARDED)
            most_gathered[0] = max(most_gathered[0], alive + (self.layout.numel if self.state is ParamState.SHARDED else 0))
        original(self, group)

    Unit.gather = watching
    try:
        for step in range(3):
            loss = engine(torch.randn(4, 16)).square().mean()
            in_backward[0] = step > 0  # the first forward records the order
            engine.backward(loss)
            in_backward[0] = False
            engine.step()
    finally:
        Unit.gather = original
    assert synchronous == []
    assert 0 < most_gathered[0] <= bound


@pytest.mark.parametrize("value, expected", [(None, 4), ("0", 0), ("1", 1), (" 8 ", 8)])
def test_host_trim_interval_from_the_environment(value, expected):
    from zerorun.zero.host_memory import trim_interval

    assert trim_interval({} if value is None else {"ZERORUN_HOST_TRIM": value}) == expected


def test_bad_host_trim_interval_is_a_config_error():
    from zerorun.zero.host_memory import trim_interval

    with pytest.raises(RuntimeConfigError, match="ZERORUN_HOST_TRIM is 'often'"):
        trim_interval({"ZERORUN_HOST_TRIM": "often"})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_units_are_updated_during_the_boundary_backward(stage, tmp_path):
    """Note [update while backward runs]: without clipping, a unit's update is queued the moment
    its gradient is final, so the model has moved before step() is called; with clipping the
    update must wait for the global norm, so nothing moves until step()."""
    for clip, moves_early in ((0.0, True), (1.0, False)):
        model = _model()
        engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
            "zero": {"stage": stage, "param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},
            "gradient_clipping": clip})
        before = engine.full_state_dict()["0.weight"].clone()
        engine.backward(((engine(torch.randn(4, 7)) - torch.randn(4, 3)) ** 2).mean())
        engine.updater._wait_for_worker()
        early = engine.full_state_dict()["0.weight"]
        assert (not torch.equal(before, early)) is moves_early, f"clip={clip}"
        engine.step()
        assert not torch.equal(before, engine.full_state_dict()["0.weight"])


def test_nvme_offload_keeps_state_in_files_and_host_memory_in_its_buffers(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {
        "zero": {"stage": 2, "reduce_bucket_size": 4160, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2, "buffer_size": 3 * 4160}}})
    for _ in range(2):
        engine.backward(engine(torch.randn(8, 64)).pow(2).mean())
        engine.step()
    engine.quiesce()
    breakdown = engine.memory_breakdown()
    n = sum(p.numel() for p in model.parameters())
    assert breakdown["optimizer_state"] == 0
    assert breakdown["offloaded_nvme"] >= 12 * n  # master + two Adam moments, fp32
    assert breakdown["offloaded_host"] == 2 * 3 * 4160 * 4  # the two buffers, nothing more
    files = list(tmp_path.glob("zerorun-*-rank0/optim*/unit*.bin"))
    assert sum(f.stat().st_size for f in files) == breakdown["offloaded_nvme"]
    assert all(r.master.numel() == 0 for r in engine.records)  # nothing resident between steps


def test_stage3_parameters_offloaded_to_nvme_live_in_files(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "zero": {"stage": 3, "param_persistence_threshold": 0,
                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    before = engine.full_state_dict()["0.weight"].clone()
    engine.backward(engine(torch.randn(8, 64)).pow(2).mean())
    engine.step()
    files = list(tmp_path.glob("zerorun-*-rank0/params*/unit*.bin"))
    breakdown = engine.memory_breakdown()
    assert files and breakdown["parameters"] == 0  # nothing partitioned is held on the device
    assert breakdown["offloaded_nvme"] == sum(f.stat().st_size for f in files)
    on_disk = torch.from_file(str(files[0]), size=files[0].stat().st_size // 4, dtype=torch.float32)
    assert torch.equal(on_disk, next(u.shard for u in (r.unit for r in engine.records) if u.index == int(files[0].stem[4:])))
    assert not torch.equal(before, engine.full_state_dict()["0.weight"])  # the update wrote through


def test_offloaded_update_uses_fused_host_kernels_unless_the_user_chose_one():
    model = _model()
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()},
                                   {"params": model[2].parameters(), "foreach": True}], lr=1e-3)
    zerorun.initialize(model, optimizer, {"zero": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert optimizer.param_groups[0]["fused"] is True
    assert optimizer.param_groups[1]["foreach"] is True and not optimizer.param_groups[1]["fused"]
    plain = _model()
    on_cpu = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    zerorun.initialize(plain, on_cpu, {"zero": {"stage": 2}})
    assert on_cpu.param_groups[0]["fused"] is True  # without a GPU the device's update is a host update
    declined = _model()
    kept = torch.optim.AdamW(declined.parameters(), lr=1e-3, fused=False)
    zerorun.initialize(declined, kept, {"zero": {"stage": 3}})
    assert kept.param_groups[0]["fused"] is False  # the user's explicit choice stands


def test_only_updates_that_run_on_the_host_prefer_fused_kernels():
    from zerorun.zero.offload.placements import OnDevice, OnHost
    from zerorun.zero.update import updates_on_host

    def record(home, device):
        return SimpleNamespace(state_home=home, master=torch.empty(4, device=device))

    assert updates_on_host(record(OnDevice(), "cpu"))
    assert updates_on_host(record(OnHost(pin_memory=False), "cpu"))
    assert not updates_on_host(record(OnDevice(), "meta"))  # a GPU's master: the user's kernels stand


def test_nvme_buffers_are_no_larger_than_the_largest_unit_needs(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64))
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {
        "zero": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}})  # default 4 x 1e8
    engine.backward(engine(torch.randn(2, 64)).sum())
    engine.step()
    assert engine.memory_breakdown()["offloaded_host"] == 4 * 3 * (64 * 64 + 64) * 4  # not 1.6 GB


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_stage3_16bit_chunk_is_the_fp32_master(precision, dtype):
    """Note [fp32 shard]: one copy per shard; a gather casts the fp32 chunk into the 16-bit
    buffer, giving exactly the master rounded once to the model dtype."""
    model = _model()
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1),
                                {"zero": {"stage": 3, "param_persistence_threshold": 0}, "precision": {"dtype": precision}})
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    for _ in range(2):
        engine.backward(((engine(x).float() - y) ** 2).mean())
        engine.step()
    for record in engine.records:
        unit = record.unit
        assert record.master is unit.shard and unit.shard.dtype == torch.float32
        assert record.master_is_model_storage
        assert unit.state is ParamState.SHARDED and unit.full.untyped_storage().nbytes() == 0
        unit.gather(None)
        assert unit.full.dtype == dtype
        assert torch.equal(unit.full[: unit.layout.numel], record.master[: unit.layout.numel].to(dtype))
        unit.release()
    breakdown = engine.memory_breakdown()
    padded = sum(r.unit.layout.padded_numel for r in engine.records)
    assert breakdown["parameters"] == 4 * padded  # fp32 chunks, nothing 16-bit beside them
    assert breakdown["optimizer_state"] == 8 * padded + 4 * len(engine.records)  # Adam's moments and step
    assert breakdown["gradients"] == 0


def test_stage3_16bit_with_offloaded_optimizer_keeps_a_16bit_chunk():
    """The fp32 shard is for state on the device only: an offloaded master lives with its state."""
    model = _model()
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1),
                                {"zero": {"stage": 3, "param_persistence_threshold": 0,
                                          "offload_optimizer": {"device": "cpu"}}, "precision": {"dtype": "bf16"}})
    for record in engine.records:
        assert record.unit.shard.dtype == torch.bfloat16 and not record.master_is_model_storage


def test_update_groups_are_capped_and_a_larger_unit_goes_alone():
    """Note [bounded update]: consecutive device units up to the cap per optimizer call; units
    whose home updates them alone come after, one per call."""
    from types import SimpleNamespace

    from zerorun.zero.update import update_batches

    def record(numel, alone=False):
        return SimpleNamespace(master=torch.empty(numel), state_home=SimpleNamespace(updates_alone=alone))

    records = [record(40), record(50), record(30), record(200), record(10), record(5, alone=True)]
    batches = update_batches(records, cap=100)
    assert [[r.master.numel() for r in b] for b in batches] == [[40, 50], [30], [200], [10], [5]]
    assert sum(len(b) for b in update_batches(records, cap=10**9)) == len(records)
    assert len(update_batches(records, cap=10**9)) == 2  # all device units together, the lone one


def test_prefetch_window_within_the_budget_and_the_live_room():
    from zerorun.zero.gather_plan import prefetch_window

    assert prefetch_window([5, 5, 5], minimum=1, budget=0, room=100) == 1  # the fixed lookahead
    assert prefetch_window([5, 5, 5], minimum=2, budget=0, room=100) == 2
    assert prefetch_window([5, 5, 5, 5], minimum=1, budget=12, room=100) == 2  # 10 <= 12 < 15
    assert prefetch_window([5, 0, 5, 5], minimum=1, budget=10, room=100) == 3  # a gathered unit costs nothing
    assert prefetch_window([20, 5], minimum=1, budget=10, room=100) == 1  # the minimum, whatever its size
    assert prefetch_window([5, 5, 5], minimum=1, budget=100, room=12) == 2  # max_live's room bounds it all
    assert prefetch_window([5, 5], minimum=2, budget=0, room=4) == 0  # even the minimum
    assert prefetch_window([], minimum=1, budget=100, room=100) == 0


def test_after_backward_passes_inputs_a_module_may_change_in_place():
    """Note [shared units] / [expert gradients]: AfterBackward sits on a module's inputs; the
    module adding to one in place (Switch Transformers' experts under checkpointing) failed
    with "Output 0 of AfterBackward is a view and is being modified inplace"."""
    from zerorun.zero.gather_plan import AfterBackward

    called = []
    x = torch.randn(3, requires_grad=True)
    (h,) = AfterBackward.apply(lambda: called.append(True), x * 2)
    h += 1.0
    (h * h).sum().backward()
    assert called == [True]
    assert torch.equal(x.grad, 2 * 2 * (x.detach() * 2 + 1.0))
