"""pytest tests/unit/test_collective_descriptors.py — descriptors, phases and the mismatch message
(zerorun/zero/comm/agreement.py), and the launcher's reading of a mismatch (launch/watchdog.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from zerorun.zero.comm import agreement
from zerorun.zero.comm.agreement import CollectiveMismatch, Descriptor


def test_a_descriptor_travels_as_eight_integers_and_back():
    d = Descriptor("reduce_scatter", (1, 17), 4104, torch.bfloat16, "backward", 0)
    assert len(d.encode()) == agreement.HEADER_NUMEL
    assert Descriptor.decode(d.encode()) == d
    assert Descriptor.decode([0] * agreement.HEADER_NUMEL) is None  # a header nobody wrote


def test_the_phase_follows_autograd_and_the_engine():
    assert agreement.current_phase() == "forward"
    with torch.no_grad():
        assert agreement.current_phase() == "eval"
        with agreement.phase("generate"):
            assert agreement.current_phase() == "generate"
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(agreement.current_phase()))
    y.sum().backward()
    assert seen == ["backward"]
    with pytest.raises(ValueError):
        with agreement.phase("lunch"):
            pass


def test_agreeing_ranks_pass_and_disagreeing_ones_raise_naming_each():
    agreement.register_units(0, dict(enumerate(["embed", "branches.2", "head", ""])))
    gather = Descriptor("all_gather", (0, 1), 48, torch.float32, "forward")
    agreement.check([gather, gather], [0, 1])
    other = Descriptor("all_gather", (0, 2), 8, torch.float32, "forward")
    with pytest.raises(CollectiveMismatch) as caught:
        agreement.check([gather, other], [0, 1])
    message = caught.value.message
    assert message.startswith("collective mismatch, stopped before any rank used its values: ")
    assert "rank 0: all_gather of unit 1 (module 'branches.2'), 48 float32 elements, in forward" in message
    assert "rank 1: all_gather of unit 2 (module 'head'), 8 float32 elements, in forward" in message
    assert "set_z3_leaf_modules" in caught.value.hint and "zero.leaf_modules" in caught.value.hint
    with pytest.raises(CollectiveMismatch):
        agreement.check([gather, None], [0, 1])  # a rank that wrote no descriptor


@pytest.mark.parametrize(("phases", "fix"), [
    (("forward", "eval"), "engine.join()"),
    (("generate", "forward"), "synced_gpus=True"),
    (("generate", "eval"), "synced_gpus=True"),
    (("backward", "step"), "the same forwards, backwards, steps"),
])
def test_the_likely_cause_names_the_fix(phases, fix):
    ds = [Descriptor("all_gather", (0, i), 8, torch.float32, phase) for i, phase in enumerate(phases)]
    assert fix in agreement.likely_cause(ds)


def test_unit_labels_are_the_module_path_the_parameters_share():
    assert agreement.unit_label(["layers.0.mlp.up.weight", "layers.0.mlp.down.bias"]) == "layers.0.mlp"
    assert agreement.unit_label(["head.weight"]) == "head"
    assert agreement.unit_label(["weight", "bias"]) == ""


def test_the_launcher_reads_a_mismatch_as_the_jobs_cause():
    from zerorun.launch.watchdog import job_cause_stated

    tail = ["[rank1]: loss 0.3", "zerorun: error: collective mismatch, stopped before any rank used its values: "
            "rank 0: all_gather ...; rank 1: all_gather ...", "zerorun: hint: likely ..."]
    assert job_cause_stated(tail).startswith("collective mismatch, stopped before")
    assert job_cause_stated(["zerorun: error: something else"]) is None


def test_synced_generate_defaults_on_and_survives_a_deepcopy():
    transformers = pytest.importorskip("transformers")
    from zerorun.zero import uneven

    calls = []

    class Recording(transformers.GPT2LMHeadModel):
        def generate(self, *args, **kwargs):  # what the class's generate is asked
            calls.append((self, kwargs.get("synced_gpus"), agreement.current_phase()))

    model = Recording(transformers.GPT2Config(vocab_size=20, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    assert uneven.sync_generate(torch.nn.Sequential(model)) == 1
    prompt = torch.ones(1, 2, dtype=torch.long)
    model.generate(prompt)
    model.generate(prompt, synced_gpus=False)
    twin = copy.deepcopy(model)
    twin.generate(prompt)
    assert [(c[1], c[2]) for c in calls] == [(True, "generate"), (False, "generate"), (True, "generate")]
    assert calls[2][0] is twin
