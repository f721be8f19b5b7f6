"""pytest tests/unit/test_restart_loop.py — ``--max-restarts``' loop (cli/run.py, launch/restarts.py)
with stand-ins for prepare and execute: the limit, the back-off, the run directories, resume only
with a checkpoint directory, never after a stop asked for. The real restart: tests/e2e/test_restarts.py.
"""

from __future__ import annotations

from types import SimpleNamespace


from zerorun.cli.run import run_with_restarts
from zerorun.launch import restarts


def failure(rank):
    return SimpleNamespace(rank=rank, host="h", reason="exit code 1")


def result(failed_rank=None, **kw):
    return SimpleNamespace(failure=failure(failed_rank) if failed_rank is not None else None, started=True,
                           interrupted=False, checkpoint_signal=None, ok=failed_rank is None, **kw)


def test_restarts_stop_at_the_limit_back_off_and_resume_only_with_a_checkpoint_dir(monkeypatch, tmp_path):
    slept: list[float] = []
    monkeypatch.setattr("time.sleep", slept.append)
    environ: dict[str, str] = {}
    monkeypatch.setattr(restarts, "set_restart_count", lambda k: environ.__setitem__("count", str(k)))
    options = SimpleNamespace(config_overrides={"zero.stage": 2}, run_dir=None)
    first = SimpleNamespace(plan=SimpleNamespace(run_dir=str(tmp_path)), options=options,
                            config_json='{"checkpoint": {"dir": "ckpt"}}')
    prepared = []

    def prepare(opts):
        prepared.append(opts)
        return SimpleNamespace(plan=SimpleNamespace(run_dir=opts.run_dir), options=opts, config_json="{}")

    monkeypatch.setattr(restarts.dataclasses, "replace", lambda o, **kw: SimpleNamespace(**{**vars(o), **kw}))
    outcomes = iter([result(1), result(0), result(1)])
    job, last, causes = run_with_restarts(first, 2, prepare, lambda job: next(outcomes))
    assert causes == ["rank 1 on host h failed: exit code 1", "rank 0 on host h failed: exit code 1"]
    assert last.failure.rank == 1 and slept == [1.0, 2.0] and environ["count"] == "2"
    assert [o.run_dir for o in prepared] == [str(tmp_path / "restart-1"), str(tmp_path / "restart-2")]
    assert all(o.config_overrides == {"zero.stage": 2, "checkpoint.resume": True} for o in prepared)
    # A stop somebody asked for is never restarted.
    stopped = SimpleNamespace(**{**vars(result(1)), "interrupted": True})
    assert not restarts.restartable(stopped)
    assert restarts.summary(causes, 2).startswith("2 restarts of --max-restarts 2; restart 1 after rank 1")
    assert [restarts.backoff_s(k) for k in (1, 2, 3, 6, 7)] == [1, 2, 4, 30, 30]
