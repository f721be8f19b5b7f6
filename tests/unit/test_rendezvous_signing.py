"""pytest tests/unit/test_rendezvous_signing.py — the signed store and the pair proof (Note [authenticated rendezvous]).

The store's values are usable only when their tag proves the secret; two ranks that hold the
same secret pass the pair proof, and a rank facing a peer without it (an impostor in a gloo
pair's place) ends with one line naming that, having sent it one random challenge. The ranks
are two subprocesses joined by a ``file://`` group; end-to-end: tests/e2e/test_rendezvous.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from zerorun.errors import RendezvousError
from zerorun.zero.comm import rendezvous


def test_values_are_used_only_when_they_prove_the_secret():
    inner = dist.HashStore()
    ours = rendezvous.SignedStore(inner, b"k" * 32, "127.0.0.1:1")
    ours.set("0//cpu//0/0", b"address of rank 0")
    assert ours.get("0//cpu//0/0") == b"address of rank 0"
    assert inner.get("0//cpu//0/0") != b"address of rank 0"  # stored with its tag
    inner.set("0//cpu//0/1", b"an address planted without the secret, long enough")
    with pytest.raises(RendezvousError, match="written by something that does not know this launch's secret"):
        ours.get("0//cpu//0/1")
    assert ours.forged == "0//cpu//0/1"
    moved = inner.get("0//cpu//0/0")
    inner.set("0//cpu//0/2", moved)  # a valid value copied to another key proves nothing there
    with pytest.raises(RendezvousError):
        ours.get("0//cpu//0/2")
    assert rendezvous.foreign_keys(ours) == 2


def test_the_secret_is_asked_for_only_by_the_launcher():
    assert rendezvous.secret_for({"ZERORUN_RUN_TOKEN": "t"}) is None  # torchrun-style: torch's own rendezvous
    secret = rendezvous.secret_for({"ZERORUN_RUN_TOKEN": "t", "ZERORUN_RENDEZVOUS": "signed"})
    assert secret is not None and b"t" not in secret
    assert rendezvous.mac(secret, "pair", 0, 1, b"x") != rendezvous.mac(secret, "pair", 1, 0, b"x")  # bound to the pair
    assert rendezvous.mac(secret, "ab", "c") != rendezvous.mac(secret, "a", "bc")


RANK = r'''
import sys, datetime, torch, torch.distributed as dist
from zerorun.errors import RendezvousError
from zerorun.zero.comm import rendezvous
rank, secret, path = int(sys.argv[1]), sys.argv[2].encode() * 4, sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
try:
    rendezvous.prove_peers(rank, 2, secret, torch.device("cpu"), "127.0.0.1:1", timeout_s=30)
    print("PROVED", flush=True)
except RendezvousError as exc:
    print("REFUSED", exc.message, flush=True)
'''


def _pair(tmp_path, secrets):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), secret, str(tmp_path / "rdv")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, secret in enumerate(secrets)]
    return [proc.communicate(timeout=240)[0] for proc in procs]


def test_ranks_that_share_the_secret_prove_it_to_each_other(tmp_path):
    said = _pair(tmp_path, ["same1234", "same1234"])
    assert all("PROVED" in line for line in said), said


def test_a_peer_without_the_secret_is_named_and_given_nothing(tmp_path):
    said = _pair(tmp_path, ["real1234", "fake1234"])
    assert "REFUSED rank 0: the connection that should be rank 1 did not prove this launch's secret" in said[0], said
    assert "REFUSED rank 1: the connection that should be rank 0 did not prove" in said[1], said
