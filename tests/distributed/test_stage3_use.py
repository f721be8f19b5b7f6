"""pytest tests/distributed/test_stage3_use.py — stage 3 gathers a unit where its parameters are used.

Hugging Face models that reach a parameter without calling the module that owns its unit
(issue 28): OPT (``OPTForCausalLM`` calls ``self.model.decoder``, never ``self.model``), BART
(one embedding shared by encoder, decoder and the tied head) and Llama wrapped by PEFT LoRA
(``PeftModel.forward`` is ``LoraModel.forward``, so ``LoraModel``'s hooks never fire). Each is
built from a tiny config (nothing downloaded), trained 3 steps with AdamW at stage 3 on 2 gloo
ranks and compared with plain torch on the same global batch: every step's loss within 1e-4
relative (fp32; the sharded run only sums gradients in another order, ~1e-7 per step).

The "reads" model computes with children's weights in its own forward (gathered on access);
after training, a value read between steps must be refused in one line naming the parameter.
The "tied-reads" model is NeoMME's masked-LM head: its forward reads, with ``@``, a weight tied
into a unit that an earlier call kept gathered for reuse (Note [kept gathered]); the tied head's
backward released that unit before the read's backward ran, until such reads were seen too.

Variants: ``default`` buckets plan one unit per model root child (OPT's whole model in the unit
of ``OPTModel``, whose forward never runs); ``small`` buckets plan several units per model.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
from gloo_world import run_ranks

pytest.importorskip("transformers", reason="transformers is in the `test` extra")

WORLD = 2
STEPS = 3
MICRO_BATCH = 2
SEQ = 8
VOCAB = 64
LR = 1e-2
SMALL = {"allgather_bucket_size": 3000, "reduce_bucket_size": 3000}
CASES = {  # name: (family, buckets); the default run takes DEFAULT_RUN, `pytest -m long` the rest
    "opt/default": ("opt", {}),
    "bart/small": ("bart", SMALL),
    "llama+lora/small": ("llama+lora", SMALL),
    "reads/small": ("reads", {"allgather_bucket_size": 500, "reduce_bucket_size": 500}),
    "tied-reads/default": ("tied-reads", {}),
    "opt/small": ("opt", SMALL),
    "bart/default": ("bart", {}),
    "llama+lora/default": ("llama+lora", {}),
}
DEFAULT_RUN = ["opt/default", "bart/small", "llama+lora/small", "reads/small", "tied-reads/default"]
LONG_RUN = [name for name in CASES if name not in DEFAULT_RUN]


class ReadsWeights(torch.nn.Module):
    """Its forward computes with a child's ``.weight`` without calling the child: the output
    head is ``F.linear`` with the embedding's weight (as XLNet-style heads do), and a bias is
    added from a second child's parameter (Note [reads outside forward] in zero/param_access.py)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 24)
        self.mix = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24))
        self.scale = torch.nn.Linear(1, VOCAB)  # only its parameters are read, never called

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        h = self.embed(input_ids)
        h = h + self.mix(h)
        logits = torch.nn.functional.linear(h, self.embed.weight) + self.scale.bias
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss)


class FactorizedEmbedding(torch.nn.Module):
    def __init__(self, rank: int, hidden: int):
        super().__init__()
        self.words = torch.nn.Embedding(VOCAB, rank)
        self.projection = torch.nn.Linear(rank, hidden, bias=False)

    def forward(self, input_ids):
        return self.projection(self.words(input_ids))


class TiedReads(torch.nn.Module):
    """NeoMME's masked-LM head: factorized embeddings, and a head that reads the tied
    projection with ``@`` in the root's own forward and calls an output Linear tied to the word
    embeddings; ``unembed`` (the projection's second name) is never called."""

    def __init__(self):
        super().__init__()
        self.embed = FactorizedEmbedding(16, 24)
        self.body = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24))
        self.unembed = torch.nn.Linear(16, 24, bias=False)
        self.head = torch.nn.Linear(16, VOCAB, bias=False)
        self.unembed.weight = self.embed.projection.weight
        self.head.weight = self.embed.words.weight

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        h = self.embed(input_ids)
        h = h + self.body(h)
        logits = self.head(h @ self.unembed.weight)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss)


def build_model(family: str) -> torch.nn.Module:
    import transformers as hf

    torch.manual_seed(1234)
    if family == "reads":
        return ReadsWeights()
    if family == "tied-reads":
        return TiedReads()
    if family == "opt":
        return hf.OPTForCausalLM(hf.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
            max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=32))
    if family == "bart":
        return hf.BartForConditionalGeneration(hf.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=48,
            decoder_ffn_dim=48, encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
    from peft import LoraConfig, get_peft_model

    base = hf.LlamaForCausalLM(hf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def global_batch(step: int) -> torch.Tensor:
    """Arithmetic progressions mod VOCAB: learnable, so the loss falls and the steps differ."""
    generator = torch.Generator().manual_seed(100 + step)
    rows = MICRO_BATCH * WORLD
    start = torch.randint(1, VOCAB, (rows, 1), generator=generator)
    stride = torch.randint(1, 4, (rows, 1), generator=generator)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)


def reference_losses(family: str) -> list[float]:
    return train_reference(family)[1]


def train_reference(family: str) -> tuple[torch.nn.Module, list[float]]:
    """Plain torch on the whole global batch: the trained model and its per-step losses."""
    model = build_model(family)
    optimizer = optimizer_for(model)
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses


def stage3_losses(family: str, buckets: dict, rank: int) -> tuple[list[float], dict]:
    import torch.distributed as dist

    import zerorun

    model = build_model(family)
    config = {"zero": {"stage": 3, "param_persistence_threshold": 0, **buckets}}
    engine = zerorun.initialize(model, optimizer_for(model), config)
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()  # every rank holds as many tokens: the mean of means is the batch's
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    return losses, read_between_steps(engine.module, family)


def read_between_steps(model: torch.nn.Module, family: str) -> dict:
    """Outside any forward: metadata reads work, a value read is refused in one line."""
    import zerorun.deepspeed  # noqa: F401  # ds_shape: the shim's (Note [attributes from the shim])
    from zerorun.errors import UsageError

    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    found = {"name": name, "shape_ok": list(param.shape) == list(param.ds_shape), "dtype": str(param.dtype)}
    try:
        param.sum()
        found["refusal"] = None
    except UsageError as err:
        found["refusal"] = str(err)
    found["index_refused"] = _refused(lambda: param[0])
    # state_dict() is DeepSpeed's: zero-element placeholders, said once; loading them fails.
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        state = model.state_dict()
        model.state_dict()
    # Frozen parameters (LoRA's base) are partitioned too (Note [frozen units]); buffers stay whole.
    params = {k for k, _ in model.named_parameters()}
    found["state_dict_numels"] = sorted({t.numel() for k, t in state.items() if k in params})
    found["state_dict_note"] = said.getvalue()
    try:
        build_model(family).load_state_dict(state)
        found["load"] = "loaded"
    except RuntimeError as err:
        found["load"] = str(err).splitlines()[0]
    return found


def _refused(read) -> bool:
    from zerorun.errors import UsageError

    try:
        read()
    except UsageError:
        return True
    return False


def each_case(rank: int, cases: list[str]) -> dict:
    torch.set_num_threads(1)  # two ranks share two cores
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    results: dict = {}
    for name in cases:
        family, buckets = CASES[name]
        try:
            losses, read = stage3_losses(family, buckets, rank)
            results[name] = {"losses": losses, "reference": reference_losses(family), "read": read}
        except Exception as err:  # reported by the case's own test, not as a crashed world
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    return results


def run_cases(out_dir: Path, cases: list[str]) -> dict:
    pytest.importorskip("peft", reason="peft is in the `test` extra")
    return run_ranks(each_case, WORLD, out_dir, cases)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_cases(tmp_path_factory.mktemp("stage3_use"), DEFAULT_RUN)


@pytest.fixture(scope="module")
def long_results(tmp_path_factory) -> dict:
    return run_cases(tmp_path_factory.mktemp("stage3_use_long"), LONG_RUN)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", DEFAULT_RUN)
def test_stage3_matches_plain_torch(results, case):
    check_parity(results, case)


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", LONG_RUN)
def test_stage3_matches_plain_torch_more_plans(long_results, case):
    check_parity(long_results, case)


def check_parity(results: dict, case: str) -> None:
    for rank in range(WORLD):
        result = results[rank][case]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        losses, reference = result["losses"], result["reference"]
        for step, (got, want) in enumerate(zip(losses, reference, strict=True)):
            assert got == pytest.approx(want, rel=1e-4), f"rank {rank} step {step}: {got} vs {want}"
        # Vacuous unless training moved the model: the last step's loss differs from the first's.
        assert abs(reference[-1] - reference[0]) > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", DEFAULT_RUN)
def test_a_value_read_between_steps_is_refused_in_one_line(results, case):
    for rank in range(WORLD):
        read = results[rank][case]["read"]
        assert read["shape_ok"] and read["dtype"] == "torch.float32"  # metadata needs no gather
        refusal = read["refusal"]
        assert refusal is not None and "\n" not in refusal
        assert f"parameter {read['name']!r} is partitioned by ZeRO stage 3" in refusal
        module = read["name"].rsplit(".", 1)[0]
        assert f"call {module!r}'s forward" in refusal
        assert read["index_refused"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_state_dict_between_steps_holds_deepspeeds_placeholders(results):
    # DeepSpeed's state_dict() of a stage-3 model holds zero-element tensors; DeepSpeed-Chat
    # saves one and overwrites it with gathered weights (docs/runtime.md, "How stage 3 gathers
    # a unit"). They must not pass for weights: loading them fails, and a note says so, once in
    # a process (the cases run one after another in each rank's process).
    for rank in range(WORLD):
        reads = [results[rank][case]["read"] for case in DEFAULT_RUN]
        for read in reads:
            assert read["state_dict_numels"] == [0], read
            assert read["load"].startswith("Error(s) in loading state_dict"), read["load"]
        notes = "".join(read["state_dict_note"] for read in reads)
        assert notes.count("\n") == 1 and "zero-element placeholders" in notes and "full_state_dict()" in notes
