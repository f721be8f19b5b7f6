"""pytest tests/unit/test_planner_memory.py: the pure memory model and the option planner."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.errors import PlannerError
from zerorun.planner.activations import ActivationJob, activation_bytes, layer_activation_bytes
from zerorun.planner.architecture import ModelSpec
from zerorun.planner.memory import (
    GRADIENT_BUCKETS_IN_FLIGHT,
    Job,
    Training,
    communication_buffer_bytes,
    estimate,
    gradient_bucket_sizes,
    shard,
    stage3_unit_sizes,
    stage3_units_in_flight,
    step_workspace_bytes,
)
from zerorun.planner.plan import Limits, make_plan
from zerorun.planner.presets import PRESETS, preset_spec

SEVEN_B = ModelSpec("7B", 7_000_000_000)


# The ZeRO paper's 7B / 8 GPU table (16-bit with Adam), except stage 3: zerorun keeps one fp32
# copy per shard (Note [fp32 shard]), 14Ψ/N bytes where the paper counts 16Ψ/N.
@pytest.mark.parametrize("stage, expected_gb", [(0, 112.0), (1, 38.5), (2, 26.25), (3, 12.25)])
def test_seed_table_7b_on_8_gpus(stage, expected_gb):
    est = estimate(SEVEN_B, Job(gpus_per_node=8), Training(stage=stage, precision="bf16"))
    assert est.model_state == pytest.approx(expected_gb * 1e9, rel=0, abs=1)


def test_seed_table_splits_into_params_grads_optimizer():
    # 16-bit: params 2Ψ, grads 2Ψ, fp32 master + Adam moments 12Ψ; stage 2 shards grads+optimizer.
    est = estimate(SEVEN_B, Job(8), Training(stage=2))
    assert (est.params, est.grads, est.optimizer) == (14e9, 14e9 / 8, 84e9 / 8)


def test_fp32_training_has_no_master_copy():
    psi, n = 1_000_000, 4
    model = ModelSpec("m", psi)
    stage0 = estimate(model, Job(n), Training(stage=0, precision="fp32"))
    assert (stage0.params, stage0.grads, stage0.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    stage1 = estimate(model, Job(n), Training(stage=1, precision="fp32"))
    assert stage1.model_state == 4 * psi + 4 * psi + 8 * psi / n


@settings(max_examples=200, deadline=None)
@given(
    psi=st.integers(1, 10**12),
    n=st.integers(1, 4096),
    precision=st.sampled_from(["fp32", "bf16", "fp16"]),
)
def test_stages_never_grow_and_stage3_is_stage0_over_n(psi, n, precision):
    model = ModelSpec("m", psi)
    states = [estimate(model, Job(n), Training(stage=s, precision=precision)).model_state for s in range(4)]
    assert states == sorted(states, reverse=True)
    # Stage 3 shards everything: N shards together hold stage 0's state, plus at most the
    # padding; in 16-bit less the model-dtype copy, the fp32 shard being the master.
    bytes_per_param = states[0] / psi
    own_copy = 0 if precision == "fp32" else 2 * psi
    assert states[3] * n == pytest.approx(states[0] - own_copy, abs=bytes_per_param * n)


def test_shards_are_padded_up():
    assert shard(10, 3) == 4
    assert shard(9, 3) == 3


def test_cpu_optimizer_offload_moves_the_optimizer_shard_to_the_host():
    job = Job(gpus_per_node=4, nodes=2)
    on_gpu = estimate(SEVEN_B, job, Training(stage=2))
    offloaded = estimate(SEVEN_B, job, Training(stage=2, offload="cpu-optimizer"))
    assert offloaded.optimizer == 0
    assert offloaded.params == on_gpu.params and offloaded.grads == on_gpu.grads
    # one unit's fp32 gradient chunk staged at a time (a 6.25M-element bucket over 8 ranks)
    staging = 4 * -(-Training().reduce_bucket_size // 8)
    # the masters are pinned from one arena (Note [pinned arena]): its slack counts, a few percent
    slack = offloaded.pinned_slack
    assert 0 < slack < 0.1 * on_gpu.optimizer
    assert offloaded.host_per_rank == on_gpu.optimizer + staging + slack
    assert offloaded.host_per_node == 4 * (on_gpu.optimizer + staging + slack)
    # a CPU worker pins nothing, nor does a run with pin_memory off
    for unpinned in (Training(stage=2, offload="cpu-optimizer", device="cpu"),
                     Training(stage=2, offload="cpu-optimizer", pin_memory=False)):
        plain = estimate(SEVEN_B, job, unpinned)
        assert plain.pinned_slack == 0 and plain.host_per_rank == on_gpu.optimizer + staging


def test_param_offload_moves_the_parameter_shard_and_nvme_the_optimizer_state():
    job = Job(8)
    base = estimate(SEVEN_B, job, Training(stage=3))
    cpu = estimate(SEVEN_B, job, Training(stage=3, offload="cpu-optimizer+params"))
    nvme = estimate(SEVEN_B, job, Training(stage=3, offload="nvme", nvme_buffer_count=1, nvme_buffer_size=10**6))
    assert cpu.params == 0 and cpu.host_per_rank > base.optimizer + base.params
    # parameters stay unless asked, as the 16-bit chunks the fp32 shard was (Note [fp32 shard])
    assert nvme.params == base.params - 2 * shard(SEVEN_B.num_params, 8) and nvme.optimizer == 0
    assert nvme.nvme_per_rank == base.optimizer + 4 * shard(SEVEN_B.num_params, 8)
    # the configured buffer, whatever the model's size, in the arena's first 4 MiB block
    assert nvme.host_per_rank == 4 * 10**6 + nvme.pinned_slack and nvme.pinned_slack == (4 << 20) - 4 * 10**6
    both = estimate(SEVEN_B, job, Training(stage=3, offload="nvme", nvme_buffer_count=1, nvme_buffer_size=10**6,
                                        nvme_params=True))
    # master + Adam's moments (12 bytes) and the 16-bit chunk (2) per element of the shard
    assert both.params == cpu.params == 0 and both.nvme_per_rank == 14 * shard(SEVEN_B.num_params, 8)


def test_offloaded_fp32_master_is_counted_beside_the_adam_state():
    job = Job(2)
    none = estimate(SEVEN_B, job, Training(stage=2, precision="fp32"))
    cpu = estimate(SEVEN_B, job, Training(stage=2, precision="fp32", offload="cpu-optimizer"))
    share = -(-SEVEN_B.num_params // 2)
    assert none.optimizer == 8 * share  # the fp32 parameter doubles as the master
    unpinned = cpu.host_per_rank - cpu.pinned_slack
    assert unpinned >= 12 * share and unpinned - 12 * share < 0.01 * unpinned


@pytest.mark.parametrize("stage, offload", [(0, "cpu-optimizer"), (0, "nvme"), (2, "cpu-optimizer+params")])
def test_unsupported_offload_is_a_planner_error(stage, offload):
    with pytest.raises(PlannerError):
        estimate(SEVEN_B, Job(8), Training(stage=stage, offload=offload))


@pytest.mark.parametrize("gpus, nodes", [(0, 1), (-1, 1), (8, 0)])
def test_bad_job_sizes_are_planner_errors(gpus, nodes):
    with pytest.raises(PlannerError):
        Job(gpus_per_node=gpus, nodes=nodes)


def test_comm_buffers_follow_bucket_sizes_and_vanish_on_one_rank():
    model = ModelSpec("m", 10**9, largest_layer_params=300_000_000)
    small = Training(stage=2, reduce_bucket_size=1000)
    alive, in_flight = GRADIENT_BUCKETS_IN_FLIGHT + 1, GRADIENT_BUCKETS_IN_FLIGHT
    # A 300M-element layer cannot be split: it becomes a bucket of its own.
    assert communication_buffer_bytes(model, Job(2), small) == alive * 2 * 300_000_000 + in_flight * 2 * 150_000_000
    many_small = ModelSpec("m", 10**9, 10)
    assert communication_buffer_bytes(many_small, Job(2), small) == alive * 2 * 1000 + in_flight * 2 * 500
    assert communication_buffer_bytes(model, Job(1), small) == 0
    # A model that fits in one bucket only ever has that one bucket alive.
    one_bucket = ModelSpec("m", 10_000, 100)
    assert communication_buffer_bytes(one_bucket, Job(4), Training(stage=2)) == 2 * 10_000 + 2 * 2_500
    # Stages 0/1 reduce and gather in place.
    assert communication_buffer_bytes(model, Job(2), Training(stage=1)) == 0
    # Stage 3 gathers whole layers: the running one, the two prefetched in backward, and
    # layer-sized buckets; a prefetch budget adds its elements ahead in backward, up to
    # max_live_parameters (twice them at the turn: test_the_turn_into_backward_holds_twice_the_budget).
    stage3 = Training(stage=3, reduce_bucket_size=1000)
    layer = 300_000_000
    assert communication_buffer_bytes(model, Job(2), stage3) == 3 * 2 * layer + alive * 2 * layer + in_flight * layer
    budget = Training(stage=3, reduce_bucket_size=1000, prefetch_bucket_size=10)
    assert communication_buffer_bytes(model, Job(2), budget) == communication_buffer_bytes(model, Job(2), stage3) + 2 * 10
    capped = Training(stage=3, reduce_bucket_size=1000, prefetch_bucket_size=10, max_live_parameters=4)
    assert communication_buffer_bytes(model, Job(2), capped) == communication_buffer_bytes(model, Job(2), stage3) + 2 * 4


def test_the_turn_into_backward_holds_twice_the_budget():
    """Note [forward runs on into backward]: at forward's last call 2B gathered ahead beside the
    fixed lookahead's G (B + T with turn_prefetch_bucket_size T), and no gradient yet; the
    larger of that and backward's peak counts."""
    from zerorun.planner.memory import turn_buffer_bytes

    model = ModelSpec("m", 10**9, largest_layer_params=300_000_000)
    layer = 300_000_000
    for precision, budget in (("fp32", 40_000_000), ("bf16", 40_000_000), ("fp32", 10**9)):
        training = Training(stage=3, precision=precision, prefetch_bucket_size=budget)
        p = training.param_bytes
        gathered = min(3 * layer + 2 * budget, 10**9)  # never more than the whole model
        assert turn_buffer_bytes(model, Job(2), training) == p * gathered - p * 10**9 // 2
        est = estimate(model, Job(2), training)
        assert est.turn_buffers == turn_buffer_bytes(model, Job(2), training)
        assert est.buffers == max(est.comm_buffers + est.backward_workspace - est.unreduced_gradients,
                                  est.workspace, est.turn_buffers)
        assert turn_buffer_bytes(model, Job(2), Training(stage=3, precision=precision)) == 0  # no budget
        assert turn_buffer_bytes(model, Job(1), training) == 0  # one rank gathers nothing
        # Backward's own window at the turn set apart (turn_prefetch_bucket_size T): G + B + T.
        turn = Training(stage=3, precision=precision, prefetch_bucket_size=budget, turn_prefetch_bucket_size=budget // 2)
        gathered = min(3 * layer + budget + budget // 2, 10**9)
        assert turn_buffer_bytes(model, Job(2), turn) == p * gathered - p * 10**9 // 2
    # 8 ranks, a budget of 40% of the model, over three gradient shards: the turn is the peak
    small = ModelSpec("s", 10**8, largest_layer_params=10**6)
    big_budget = Training(stage=3, prefetch_bucket_size=40_000_000)
    est = estimate(small, Job(8), big_budget)
    assert est.buffers == est.turn_buffers > est.comm_buffers + est.backward_workspace - est.unreduced_gradients


def test_the_step_holds_the_next_forwards_first_gathers():
    """Note [next forward's gathers in the step]: with a budget B the step's workspace holds the
    first call's unit and the window it prefetches, p·(U + max(B, U)), never more than the model;
    nothing without a budget or on one rank."""
    model = ModelSpec("m", 10**9, largest_layer_params=300_000_000)
    layer = 300_000_000
    for precision in ("fp32", "bf16"):
        plain = Training(stage=3, precision=precision, device="cpu")
        p = plain.param_bytes
        base = step_workspace_bytes(model, Job(2), plain)
        for budget, ahead in ((40_000_000, 2 * layer), (500_000_000, layer + 500_000_000), (10**9, 10**9)):
            training = Training(stage=3, precision=precision, device="cpu", prefetch_bucket_size=budget)
            assert step_workspace_bytes(model, Job(2), training) == base + p * ahead, (precision, budget)
            assert step_workspace_bytes(model, Job(1), training) == step_workspace_bytes(model, Job(1), plain)
    offloaded = Training(stage=3, offload="cpu-optimizer", device="cpu", prefetch_bucket_size=40_000_000)
    assert step_workspace_bytes(model, Job(2), offloaded) == \
        step_workspace_bytes(model, Job(2), Training(stage=3, offload="cpu-optimizer", device="cpu")) + 2 * 2 * layer  # bf16 by default


def test_the_engine_constants_match_the_planner():
    from zerorun.zero import grad_reduce

    assert grad_reduce.MAX_IN_FLIGHT == GRADIENT_BUCKETS_IN_FLIGHT
    from zerorun.planner.memory import GATHERED_LAYERS
    from zerorun.zero.unit.plan import BACKWARD_PREFETCH

    assert GATHERED_LAYERS == 1 + BACKWARD_PREFETCH  # the running layer and the prefetched ones


def test_workspace_depends_on_precision_and_device():
    psi, n = 10_000_000, 2
    model = ModelSpec("m", psi, largest_layer_params=1000, param_sizes=(1000,) * (psi // 1000))
    cpu32 = step_workspace_bytes(model, Job(n), Training(stage=1, precision="fp32", device="cpu",
                                                           reduce_bucket_size=100_000))
    assert cpu32 == 4 * 1000  # the fused CPU kernel updates in place (Note [host optimizer kernels])
    cuda32 = step_workspace_bytes(model, Job(n), Training(stage=1, precision="fp32", device="cuda"))
    assert cuda32 == 4 * 1000 + 4 * psi // n
    # bf16 stage 1 upcasts its gradient slice; stage 2 keeps fp32 gradient shards.
    bf16_1 = step_workspace_bytes(model, Job(n), Training(stage=1, precision="bf16", device="cuda"))
    bf16_2 = step_workspace_bytes(model, Job(n), Training(stage=2, precision="bf16", device="cuda"))
    assert bf16_1 == 2 * 1000 + 4 * psi // n + 4 * psi // n
    assert bf16_2 == 2 * 1000 + 2 * psi // n + 4 * psi // n
    # Note [bounded update]: one optimizer call's temporaries, not the rank's whole share.
    capped = step_workspace_bytes(model, Job(n), Training(stage=1, precision="bf16", device="cuda",
                                                            reduce_bucket_size=100_000, update_bucket_size=100_000))
    assert capped == 2 * 1000 + 4 * 100_000 + 4 * 100_000


def test_stage3_16bit_chunks_are_their_own_masters():
    """Note [fp32 shard]: no model-dtype chunk beside the fp32 master without offload."""
    model = ModelSpec("m", 8_000_000)
    est = estimate(model, Job(2), Training(stage=3, precision="bf16", param_persistence_threshold=0))
    assert (est.params, est.grads, est.optimizer) == (4 * 4e6, 2 * 4e6, 8 * 4e6)
    offloaded = estimate(model, Job(2), Training(stage=3, precision="bf16", offload="cpu-optimizer",
                                                 param_persistence_threshold=0))
    assert offloaded.params == 2 * 4e6  # the master is on the host: the device chunk stays 16-bit


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_backward_peak_leaves_out_the_gathered_units_gradient_shards(precision):
    """Note [lazy gradient shards]: the units gathered at backward's peak are not reduced yet,
    so their fp32 shards (4 bytes per element in every precision) come off that peak; at stage 2
    the buckets alive have none yet; stage 1 and one rank have no buffers to credit against."""
    model = ModelSpec("m", 10**9, largest_layer_params=300_000_000)
    stage3 = Training(stage=3, precision=precision)
    est = estimate(model, Job(4), stage3)
    gathered, unit, units = stage3_unit_sizes(model, stage3)
    # Without parameter sizes: three units gathered and two reduce-scattering, none of them
    # with a shard yet (in fp32 the buckets column already counts the in-flight outputs).
    assert (units, stage3_units_in_flight(units)) == (6, GRADIENT_BUCKETS_IN_FLIGHT)
    assert est.unreduced_gradients == 4 * shard(gathered, 4) + 4 * GRADIENT_BUCKETS_IN_FLIGHT * shard(unit, 4)
    assert stage3_units_in_flight(4) == 1 and stage3_units_in_flight(2) == 0  # never more units than there are
    backward = est.comm_buffers + est.backward_workspace - est.unreduced_gradients
    assert est.buffers == max(backward, est.workspace)
    stage2 = replace(stage3, stage=2)
    alive = sorted(gradient_bucket_sizes(model, stage2), reverse=True)[:GRADIENT_BUCKETS_IN_FLIGHT + 1]
    assert estimate(model, Job(4), stage2).unreduced_gradients == 4 * sum(shard(b, 4) for b in alive) > 0
    assert estimate(model, Job(4), replace(stage3, stage=1)).unreduced_gradients == 0
    assert estimate(model, Job(1), stage3).unreduced_gradients == 0


def test_stage3_keeps_small_units_whole():
    """Note [persistent units]: a unit at or below the threshold stays whole on every rank; a small
    tensor inside a larger unit (the block's bias) is sharded with it."""
    from zerorun.zero.unit.plan import ModuleNode, ParamNode

    block = ModuleNode("block", True, (ParamNode("w", 1_000_000), ParamNode("b", 60)), ())
    tree = ModuleNode("", True, (ParamNode("norm", 50),), (block,))
    model = ModelSpec("m", 1_000_110, param_sizes=(1_000_000, 60, 50), module_tree=tree)
    training = Training(stage=3, precision="fp32", param_persistence_threshold=100, allgather_bucket_size=500_000)
    est = estimate(model, Job(10), training)
    assert est.params == 4 * (shard(1_000_060, 10) + 50)
    assert est.grads == 4 * shard(1_000_110, 10)  # the whole unit's gradients are still sharded
    assert estimate(model, Job(10), replace(training, param_persistence_threshold=0)).params == 4 * shard(1_000_110, 10)


def test_activations_reduce_to_the_paper_formula_for_gpt2():
    # The paper assumes a fused GeLU; the gpt2 preset models HF's unfused one (3 more s·b·i).
    shape = replace(PRESETS["gpt2"], unfused_gelu=False)
    b, s, h, a = 2, 1024, shape.hidden, shape.heads
    job = ActivationJob(micro_batch=b, seq_len=s)
    # Korthikanti et al. 2022, eq. (1): s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit.
    assert layer_activation_bytes(shape, job, q=2) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert layer_activation_bytes(shape, job, q=4) == 2 * layer_activation_bytes(shape, job, q=2)
    unfused = layer_activation_bytes(PRESETS["gpt2"], job, q=2)
    assert unfused - layer_activation_bytes(shape, job, q=2) == 2 * 3 * s * b * shape.intermediate


def test_checkpointing_keeps_layer_inputs_plus_one_layer():
    shape = PRESETS["llama-7b"]
    full = activation_bytes(shape, ActivationJob(1, 4096), q=2)
    ckpt = activation_bytes(shape, ActivationJob(1, 4096, checkpointing=True), q=2)
    per_layer = layer_activation_bytes(shape, ActivationJob(1, 4096), q=2)
    logits = 1 * 4096 * shape.vocab * (2 + 4)
    assert full == pytest.approx(shape.layers * per_layer + logits)
    assert ckpt == pytest.approx(shape.layers * 2 * 4096 * shape.hidden + per_layer + logits)
    assert ckpt < full / 5


def test_activations_are_unknown_without_an_architecture():
    est = estimate(SEVEN_B, Job(8), Training(), ActivationJob(1, 2048))
    assert est.activations is None
    est = estimate(preset_spec("llama-7b"), Job(8), Training(), ActivationJob(1, 2048))
    assert est.activations > 0


def test_plan_recommends_the_cheapest_option_that_fits():
    def pick(gpu_gb, host_gb=None):
        plan = make_plan(SEVEN_B, Job(8), Training(), limits=Limits(gpu_gb * 1e9, host_gb and host_gb * 1e9))
        best = plan.recommended
        return None if best is None else (best.estimate.stage, best.estimate.offload)

    # 7B, 8 GPUs, bf16 on CUDA. GPU totals derived by hand from docs/estimate.md; buffers are
    # max(backward: buckets/gathers + fp32 grad shard extra, step: that extra + Adam temporaries),
    # the step's upcast and Adam temporaries bounded by one optimizer call of
    # update_bucket_size = 6.25M elements (Note [bounded update]): 2 x 4 x 6.25M = 0.05 GB.
    # stage 0: 112 + 0.05 = 112.05;  stage 1: 38.5 + 0.05 = 38.55
    # (buckets of 6.25M elements: 3 x 0.0125 GB alive + 2 x 0.0015625 GB receive slices = 0.040625)
    # stage 2: 26.25 + max(buckets 0.040625 + fp32 grad shard extra 1.75, 1.75 + Adam 0.025) = 28.040625
    # stage 3 (14Ψ/N, Note [fp32 shard]): 12.25 + max(gathered + buckets 0.078125 + 1.75 - 0.009375, 1.775) = 14.06875
    # stage 2 + cpu optimizer: 14 + 1.75 + 0.040625 = 15.790625 (nothing else stays on the GPU)
    # stage 3 + cpu optimizer: 1.75 + 1.75 + 0.078125 = 3.578125
    assert pick(113) == (0, "none")
    assert pick(112) == (1, "none")
    assert pick(38.6) == (1, "none")
    assert pick(38.5) == (2, "none")
    assert pick(28.05) == (2, "none")
    assert pick(28.0) == (3, "none")
    assert pick(14.1) == (3, "none")
    # stage 2 + cpu optimizer (15.79) no longer fits anywhere stage 3 does not
    assert pick(14.0) == (3, "cpu-optimizer")
    assert pick(3.6) == (3, "cpu-optimizer")
    # the host cannot hold 8 optimizer shards (8 x 10.5 GB), NVMe can
    assert pick(3.6, host_gb=50) == (3, "nvme")
    assert pick(0.1) is None


def test_plan_lists_every_supported_option_once():
    plan = make_plan(SEVEN_B, Job(8), Training())
    labels = [(o.estimate.stage, o.estimate.offload) for o in plan.options]
    assert len(labels) == len(set(labels)) == 11
    assert plan.recommended is None  # no limits: no verdict
    assert plan.requested.estimate.stage == 0
    assert all(math.isfinite(o.estimate.gpu_total) for o in plan.options)


@pytest.mark.parametrize("sizes", [[3 * 2**20 + 1] * 40, [700 << 10] * 300 + [40 << 20] * 3,
                                   [100, 5 << 20, 513, 300 << 20, 1 << 20], []])
def test_pinned_arena_rule_is_what_the_arena_reserves(monkeypatch, sizes):
    """The planner's pinned bytes (reserved_for) equal what HostArena reserves for the same
    pieces in the same order; pinning is faked (no CUDA here), the carving is the arena's."""
    import torch

    from zerorun.zero.offload import pinned

    real_empty = torch.empty
    monkeypatch.setattr(pinned.torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    arena = pinned.HostArena(pin=True)
    for nbytes in sizes:
        assert arena.empty(nbytes, torch.uint8).numel() == nbytes
    assert pinned.reserved_for(sizes) == arena.reserved
    assert arena.slack() == arena.reserved - sum(sizes) >= 0


def test_planner_pinned_slack_is_the_arena_rule_over_the_unit_masters():
    """cpu offload at stage 2: the masters are one fp32 shard per gradient bucket, in order."""
    from zerorun.planner.memory import gradient_bucket_sizes
    from zerorun.zero.offload.pinned import reserved_for

    training = Training(stage=2, offload="cpu-optimizer", reduce_bucket_size=3_000_000)
    masters = [4 * shard(b, 4) for b in gradient_bucket_sizes(SEVEN_B, training)]
    planned = estimate(SEVEN_B, Job(4), training)
    assert planned.pinned_slack == reserved_for(masters) - sum(masters) > 0
