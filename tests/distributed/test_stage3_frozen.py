"""pytest tests/distributed/test_stage3_frozen.py — frozen models at stage 3, and what a program may do with a built model.

Issue 36 (items 4, 5) and issue 41 (row 2), on gloo ranks with tiny Llamas built from configs:

* a policy trained beside a frozen reference (DPO's shape: the reference initialized alone, with
  no optimizer), and PEFT LoRA on attention *and* the input embedding (PEFT reads
  ``lora_embedding_A[...].T`` in its forward): every step's loss equal to plain torch on the
  same global batch within 1e-4 relative, at 2 ranks;
* memory: the frozen reference and the LoRA model hold at most 1/N + 5% of their parameter
  bytes per rank (``engine.memory_breakdown()["parameters"]``) at 2 and 3 ranks, where every
  rank held all of a frozen model before;
* a frozen model's checkpoint (the LoRA model's base) saved and loaded into a fresh engine gives
  every parameter back bit for bit;
* between steps ``.data``, ``.T``, views and ``.numpy()`` of a partitioned parameter are refused
  in one line (``w.data.sum()`` crashed the rank); ``detach()`` is DeepSpeed's zero-element
  placeholder; a move of the model to where it is (any spelling) does nothing, a move to another
  dtype is refused in one line; ``resize_token_embeddings`` after initialize is refused in one
  line at stages 2 and 3, naming the way that works (resize before initialize);
* with the DeepSpeed shim imported every stage-3 parameter, frozen ones too, carries ``ds_*``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gloo_world import run_ranks

pytest.importorskip("transformers", reason="transformers is in the `test` extra")

STEPS = 3
MICRO_BATCH = 2
SEQ = 8
VOCAB = 64
LR = 1e-2
BETA = 0.5  # weight of the policy's squared distance to the reference's log-probabilities
CONFIG = {"zero": {"stage": 3, "param_persistence_threshold": 0}}


def llama(seed: int = 1234) -> torch.nn.Module:
    import transformers as hf

    torch.manual_seed(seed)
    return hf.LlamaForCausalLM(hf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def lora_model() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens"], lora_dropout=0.0)
    model = get_peft_model(llama(), config)
    torch.manual_seed(7)  # PEFT starts an embedding's LoRA A at zero: give both factors values
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_embedding" in name:
                param.normal_(0, 0.1)
    return model


def reference_model() -> torch.nn.Module:
    model = llama()  # the policy's starting point, as DPO's reference is
    model.requires_grad_(False)
    return model


def global_batch(step: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    rows = MICRO_BATCH * world
    start = torch.randint(1, VOCAB, (rows, 1), generator=generator)
    stride = torch.randint(1, 4, (rows, 1), generator=generator)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)


def policy_loss(policy_out, reference_logits, ids) -> torch.Tensor:
    logp = torch.log_softmax(policy_out.logits, -1)
    ref_logp = torch.log_softmax(reference_logits, -1)
    return policy_out.loss + BETA * (logp - ref_logp).pow(2).mean()


def plain_losses(case: str, world: int) -> list[float]:
    """Plain torch on the whole global batch."""
    model = lora_model() if case == "lora" else llama()
    reference = reference_model() if case == "policy+reference" else None
    optimizer = optimizer_for(model)
    losses = []
    for step in range(STEPS):
        ids = global_batch(step, world)
        out = model(input_ids=ids, labels=ids)
        if reference is not None:
            with torch.no_grad():
                ref_logits = reference(input_ids=ids).logits
            loss = policy_loss(out, ref_logits, ids)
        else:
            loss = out.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def stage3_run(case: str, rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    import zerorun

    model = lora_model() if case == "lora" else llama()
    whole = param_bytes(model)
    engine = zerorun.initialize(model, optimizer_for(model), CONFIG)
    found: dict = {"whole": whole}
    if case == "policy+reference":
        reference = reference_model()
        found["whole"] = param_bytes(reference)
        ref_engine = zerorun.initialize(reference, None, CONFIG)  # no optimizer: DeepSpeed allows it
        found["memory"] = ref_engine.memory_breakdown()["parameters"]
    else:
        found["memory"] = engine.memory_breakdown()["parameters"]
    losses = []
    for step in range(STEPS):
        ids = global_batch(step, world)[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
        out = engine(input_ids=ids, labels=ids)
        if case == "policy+reference":
            with torch.no_grad():
                ref_logits = ref_engine(input_ids=ids).logits
            loss = policy_loss(out, ref_logits, ids)
        else:
            loss = out.loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    found["losses"] = losses
    if case == "policy+reference":
        found["memory_after"] = ref_engine.memory_breakdown()["parameters"]
        found["reads"] = reads_between_steps(reference)
        found["ds"] = ds_attributes(reference)
    elif case == "lora":
        found["memory_after"] = engine.memory_breakdown()["parameters"]
        found["resumed_equal"] = resume_equal(engine, out_dir, rank)
    return found


def reads_between_steps(model: torch.nn.Module) -> dict:
    """What each access to a frozen, partitioned parameter does outside any forward."""
    from zerorun.errors import UsageError

    weight = model.model.layers[0].self_attn.q_proj.weight
    reads = {"data.sum": lambda: weight.data.sum(), "T": lambda: weight.T + 0, "mT": lambda: weight.mT,
             "view": lambda: weight.view(-1), "reshape": lambda: weight.reshape(-1), "numpy": lambda: weight.numpy(),
             "index": lambda: weight[0], "to(float16)": lambda: model.to(torch.float16),
             "type(float16)": lambda: weight.type(torch.float16)}
    found: dict = {}
    for name, read in reads.items():
        try:
            read()
            found[name] = "ran"
        except UsageError as err:
            found[name] = str(err)
    found["shape"] = list(weight.data.shape) if found["data.sum"] != "ran" else None
    found["detach_numel"] = weight.detach().numel()
    before = weight.dtype, weight.device
    model.to("cpu")
    model.to(torch.device("cpu"))
    model.cpu()
    model.to(torch.float32)
    model.to("cpu", torch.float32)
    found["moves_kept"] = (weight.dtype, weight.device) == before and type(weight).__name__ == "ShardedParameter"
    return found


def ds_attributes(model: torch.nn.Module) -> dict:
    import zerorun.deepspeed  # noqa: F401  # the shim attaches ds_* to engines already built
    from zerorun.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(model.parameters())
    return {"all": all(hasattr(p, "ds_status") and hasattr(p, "ds_id") for p in params),
            "shapes": all(tuple(p.ds_shape) == tuple(p.shape) and p.ds_numel == p.numel() for p in params),
            "not_available": sum(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params), "count": len(params)}


def resume_equal(engine, out_dir: str, rank: int) -> bool:
    """Save, load into a fresh engine over a fresh model, compare every parameter bit for bit."""
    import zerorun

    engine.save_checkpoint(os.path.join(out_dir, "ckpt"), tag="t")
    saved = engine.full_state_dict(rank0_only=False)
    model = lora_model()
    fresh = zerorun.initialize(model, optimizer_for(model), CONFIG)
    fresh.load_checkpoint(os.path.join(out_dir, "ckpt"), tag="t")
    loaded = fresh.full_state_dict(rank0_only=False)
    return set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)


def resize_refusals(rank: int) -> dict:
    import zerorun
    from zerorun.errors import UsageError

    found = {}
    for stage in (2, 3):
        model = llama()
        zerorun.initialize(model, optimizer_for(model), {"zero": {"stage": stage}})
        try:
            model.resize_token_embeddings(VOCAB + 8)
            found[stage] = "ran"
        except UsageError as err:
            found[stage] = str(err)
    return found


def run_cases(rank: int, world: int, out_dir: str, cases: list[str], parity: bool) -> dict:
    torch.set_num_threads(1)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    results: dict = {}
    for case in cases:
        try:
            if case == "resize":
                results[case] = resize_refusals(rank)
            else:
                results[case] = stage3_run(case, rank, world, out_dir)
                if parity:
                    results[case]["reference"] = plain_losses(case, world)
        except Exception as err:  # reported by the case's own test
            results[case] = {"error": f"{type(err).__name__}: {err}"}
    return results


def run_world(out_dir: Path, world: int, cases: list[str], parity: bool) -> dict:
    pytest.importorskip("peft", reason="peft is in the `test` extra")
    return run_ranks(run_cases, world, out_dir, world, str(out_dir), cases, parity)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    return run_world(tmp_path_factory.mktemp("frozen2"), 2, ["policy+reference", "lora", "resize"], parity=True)


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> dict:
    return run_world(tmp_path_factory.mktemp("frozen3"), 3, ["policy+reference", "lora"], parity=False)


def _result(results: dict, rank: int, case: str) -> dict:
    result = results[rank][case]
    assert "error" not in result, f"rank {rank}: {result.get('error')}"
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["policy+reference", "lora"])
def test_stage3_with_frozen_parameters_matches_plain_torch(two, case):
    for rank in range(2):
        result = _result(two, rank, case)
        for step, (got, want) in enumerate(zip(result["losses"], result["reference"], strict=True)):
            assert got == pytest.approx(want, rel=1e-4), f"rank {rank} step {step}: {got} vs {want}"
        assert abs(result["reference"][-1] - result["reference"][0]) > 1e-3  # training moved the model


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["policy+reference", "lora"])
def test_a_frozen_model_holds_its_share(two, three, world, case):
    results = two if world == 2 else three
    for rank in range(world):
        result = _result(results, rank, case)
        bound = result["whole"] * (1 / world + 0.05)
        assert result["memory"] <= bound and result["memory_after"] <= bound, (rank, result, bound)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_frozen_base_resumes_bit_for_bit(two):
    for rank in range(2):
        assert _result(two, rank, "lora")["resumed_equal"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reads_of_a_partitioned_parameter_are_refused_in_one_line(two):
    for rank in range(2):
        reads = _result(two, rank, "policy+reference")["reads"]
        name = "model.layers.0.self_attn.q_proj.weight"
        for access in ("data.sum", "T", "mT", "view", "reshape", "numpy", "index", "type(float16)"):
            refusal = reads[access]
            assert refusal != "ran" and "\n" not in refusal, (access, refusal)
            assert f"parameter {name!r} is partitioned by ZeRO stage 3" in refusal, (access, refusal)
        move = reads["to(float16)"]
        assert "cannot move to float16 after initialize" in move and "\n" not in move
        assert reads["detach_numel"] == 0  # DeepSpeed's placeholder
        assert reads["moves_kept"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resize_token_embeddings_after_initialize_is_refused_in_one_line(two):
    for rank in range(2):
        for stage, refusal in _result(two, rank, "resize").items():
            assert "resize_token_embeddings after initialize is not supported" in refusal, (stage, refusal)
            assert "before zerorun.initialize" in refusal and "\n" not in refusal


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_frozen_parameters_carry_deepspeeds_attributes(two):
    for rank in range(2):
        ds = _result(two, rank, "policy+reference")["ds"]
        assert ds["all"] and ds["shapes"] and ds["not_available"] == ds["count"]
