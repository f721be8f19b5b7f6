"""pytest tests/integrations/test_model_zoo.py — Hugging Face model families at ZeRO stage 3.

The zoo (scripts/model_zoo.py, table in docs/zoo.md): every family of transformers' causal-LM,
masked-LM, seq-to-seq-LM and image-classification mappings built from a tiny config, trained 3
steps on 2 gloo ranks and compared per step with plain torch on the same global batch (fp32,
1e-4 relative). By default a named sample runs in one 2-rank world: OPT, BART, T5, Llama,
Llama + PEFT LoRA and ViT at stage 3, and a sample at stages 1 and 2; and a sample of the fine
set (``FINE_SAMPLE``: every module its own unit, gradient checkpointing, the gather pool off,
LoRA on attention and the embedding, bf16, an MoE whose rank 0 leaves experts idle, a compiled
model) in another; under ``-m long`` a
compiled Llama at stages 1-3. Under ``-m zoo`` (also
marked long; .ci/run leaves it out for time) the whole zoo runs at stage 3 (and so does the fine set): at least 95% of the families that build must pass, and every failure
must be zerorun's own one-line error, never a crash inside torch or a silent loss difference
(a known exception would be listed with its cause in ``KNOWN_UNCLEAR``; none is now).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zerorun import errors

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ["causal-lm/opt", "seq2seq-lm/bart", "seq2seq-lm/t5", "causal-lm/llama", "causal-lm/llama+lora",
          "image-classification/vit"]
# Failures found by the zoo and not fixed yet, each with its cause; listed so that the test
# fails on any other unclear failure and tells whoever fixes one of these to take it off.
KNOWN_UNCLEAR: dict[str, str] = {}
LOWER_STAGES = {1: ["causal-lm/llama", "seq2seq-lm/bart"], 2: ["causal-lm/opt+lora", "image-classification/vit"]}
# The fine set's sample (scripts/model_zoo.py ``Setting``: plan, checkpointing, pool, use_cache,
# skew), each a row of issue 36 that failed before: Hugging Face's non-reentrant checkpointing
# recorded the recomputation as forward calls (IndexError at the 2nd forward) and, with the gather
# pool off, trained on wrong values (GPT-2 1.8e-3 relative); zerorun's own checkpointing refused
# T5 with its cache (torch's CheckpointError); a per-expert MoE whose rank 0 leaves experts idle
# gathered them on one rank only (a hang); PEFT LoRA on an input embedding read ``.T`` of an
# ungathered weight (``setStorage``). The Llama and LoRA cases run in bf16 and with LoRA on the
# embedding as well (scripts/zoo_settings.py: plain torch in the same precision, 1e-4). GPT-2
# (its head tied to the token embedding) also runs with a prefetch budget under recomputation:
# forward's window running on into backward, the tied unit held from forward's first call; and
# with its tied embedding's rows (zero.tied_embedding_rows: the lookup reads rows, its gradient is
# sent as rows, the table gathered at the head).
FINE_SAMPLE = [
    ("causal-lm/llama", dict(plan="fine", checkpointing="non-reentrant", dtype="bf16")),
    ("causal-lm/gpt2", dict(checkpointing="non-reentrant", pool=False)),
    ("seq2seq-lm/t5", dict(plan="fine", checkpointing="reentrant", pool=False)),
    ("seq2seq-lm/t5", dict(checkpointing="zerorun", use_cache=True)),
    ("causal-lm/plain_moe", dict(plan="fine", pool=False, skew=True)),
    ("seq2seq-lm/switch_transformers", dict(plan="fine", skew=True)),
    ("causal-lm/llama", dict(plan="fine", checkpointing="non-reentrant", pool=False, lora="attention+embedding")),
    ("causal-lm/plain_moe", dict(plan="fine", compile="before")),
    ("causal-lm/gpt2", dict(plan="fine", checkpointing="non-reentrant", pool=False, prefetch=True)),
    ("causal-lm/gpt2", dict(plan="fine", checkpointing="non-reentrant", pool=False, prefetch=True, rows=True)),
]
# torch.compile of the model before and after initialize (AOT autograd through dynamo: the
# zoo's COMPILE_BACKEND): at stage 3 dynamo traced into the gather hooks and failed
# (InternalTorchDynamoError); the hooks now run eagerly at graph breaks (Note [hooks outside
# the graph] in zerorun/zero/param_gather.py).
COMPILED = {stage: ["causal-lm/llama"] for stage in (1, 2, 3)}


def _zoo():
    # By name, from scripts/ on sys.path: the spawned ranks unpickle its functions the same way.
    sys.path.insert(0, str(ROOT / "scripts"))
    import model_zoo

    return model_zoo


def _jobs(zoo, names_by_stage: dict[int, list[str]]):
    families = zoo.all_families()
    return [(family, stage, zoo.DEFAULT) for stage, names in names_by_stage.items()
            for family in zoo.select(families, names)]


def _report(outcomes) -> str:
    return "\n".join(f"{o.family} stage {o.stage} {o.setting}: {o.status} {o.detail}" for o in outcomes)


def _check_passed(zoo, outcome) -> None:
    """What "passed" means, checked here rather than trusted."""
    assert len(outcome.losses) == zoo.STEPS
    assert outcome.losses == pytest.approx(outcome.reference, rel=outcome.tolerance)


def test_named_sample_matches_plain_torch(tmp_path):
    zoo = _zoo()
    outcomes = zoo.run_zoo(_jobs(zoo, {3: SAMPLE, **LOWER_STAGES}), tmp_path)
    assert len(outcomes) == len(SAMPLE) + sum(len(n) for n in LOWER_STAGES.values())
    assert all(o.status == "passed" for o in outcomes), _report(outcomes)
    for outcome in outcomes:
        _check_passed(zoo, outcome)
        trainable, total = outcome.trainable
        if outcome.family.endswith("+lora"):  # a frozen base, the adapters alone train
            assert 0 < trainable < total / 10, outcome.trainable
        else:
            assert trainable == total


@pytest.mark.timeout(1800)
def test_fine_sample_matches_plain_torch(tmp_path):
    """Every module its own unit, under recomputation, the GPU path emulated, idle experts."""
    zoo = _zoo()
    families = zoo.all_families()
    jobs = [(zoo.select(families, [name])[0], 3, zoo.Setting(**setting)) for name, setting in FINE_SAMPLE]
    outcomes = zoo.run_zoo(jobs, tmp_path)
    assert [(o.family, o.setting) for o in outcomes] == [(f.name, s.tag) for f, _, s in jobs]
    assert all(o.status == "passed" for o in outcomes), _report(outcomes)
    for outcome in outcomes:
        _check_passed(zoo, outcome)


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_compiled_model_matches_plain_torch(tmp_path):
    zoo = _zoo()
    families = zoo.all_families()
    jobs = [(family, stage, zoo.Setting(compile=when)) for stage, names in COMPILED.items()
            for family in zoo.select(families, names) for when in ("before", "after")]
    outcomes = zoo.run_zoo(jobs, tmp_path)
    assert all(o.status == "passed" for o in outcomes), _report(outcomes)
    for outcome in outcomes:
        _check_passed(zoo, outcome)


def _clean_error(outcome) -> bool:
    """zerorun's own error type, one line that names the model's parameter or module."""
    kind = getattr(errors, outcome.error_type, None)
    return isinstance(kind, type) and issubclass(kind, errors.ZerorunError) and "\n" not in outcome.detail


@pytest.mark.long
@pytest.mark.zoo  # left out of .ci/run's long tests: alone it would take most of CI's time budget
@pytest.mark.timeout(5400)  # the families took 43 min in all when three worlds shared 2 loaded cores
def test_whole_zoo_at_stage_3(tmp_path):
    zoo = _zoo()
    outcomes = zoo.run_zoo([(family, 3, zoo.DEFAULT) for family in zoo.all_families()], tmp_path)
    counts = zoo.summary(outcomes)
    assert counts["built"] >= 0.5 * counts["tried"], counts  # the tiny configs build for most families
    assert counts["passed"] >= 0.95 * counts["built"], f"{counts}\n" + _report(o for o in outcomes if o.status == "failed")
    unclear = [o for o in outcomes if o.status == "failed" and not _clean_error(o)]
    assert not [o for o in unclear if o.family not in KNOWN_UNCLEAR], _report(unclear)
    for name, text in KNOWN_UNCLEAR.items():
        outcome = next(o for o in outcomes if o.family == name)
        assert outcome.status == "failed" and text in outcome.detail, f"{name} changed: {outcome.detail} (update KNOWN_UNCLEAR)"
    for name in SAMPLE:
        assert next(o for o in outcomes if o.family == name).status == "passed", name


@pytest.mark.long
@pytest.mark.zoo
@pytest.mark.timeout(3 * 5400)
def test_whole_zoo_under_the_fine_plan(tmp_path):
    """``fine_plan_jobs``: as the whole zoo, for every setting of the fine set."""
    zoo = _zoo()
    outcomes = zoo.run_zoo(zoo.fine_plan_jobs(zoo.all_families()), tmp_path)
    for setting in sorted({o.setting for o in outcomes}):
        group = [o for o in outcomes if o.setting == setting]
        counts = zoo.summary(group)
        assert counts["passed"] >= 0.95 * counts["built"], f"{setting} {counts}\n" + \
            _report(o for o in group if o.status == "failed")
        assert not [o for o in group if o.status == "failed" and not _clean_error(o)], _report(group)
    for name, setting in FINE_SAMPLE:
        tag = zoo.Setting(**setting).tag
        assert all(o.status == "passed" for o in outcomes if o.family == name and o.setting == tag), (name, tag)
