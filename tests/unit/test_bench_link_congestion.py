"""pytest tests/unit/test_bench_link_congestion.py — scripts/bench_link.py --congestion-control:
the name is checked against the kernel's list before any namespace exists (one line, exit 2),
and it goes on the link's route in each namespace, never into the machine's own settings."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_link  # noqa: E402  (scripts/ is not a package)


def test_a_name_the_kernel_has_or_host_passes():
    assert bench_link.congestion_problem("cubic", "reno bbr cubic\n") is None
    assert bench_link.congestion_problem("host", "") is None


def test_a_name_the_kernel_lacks_is_one_line_naming_what_it_has():
    problem = bench_link.congestion_problem("vegas", "reno bbr cubic\n")
    assert problem == ("--congestion-control vegas: this kernel has no such TCP congestion control "
                       "(available: reno bbr cubic); name one of them, or 'host' for the machine's default")
    assert "\n" not in problem


def test_the_route_of_each_namespace_carries_it():
    link = bench_link.Link(tag="zrl42")
    for host in (0, 1):
        command = bench_link.route_command(link, host, "cubic")
        assert command[:3] == ["ip", "-n", link.namespaces[host]]
        assert command[command.index("route") + 1] == "change"  # the connected route, not a sysctl
        assert command[command.index("change") + 1] == link.subnet
        assert link.address(host).rsplit(".", 1)[0] == link.subnet.rsplit(".", 1)[0]
        assert command[command.index("dev") + 1] == link.interfaces[host]
        assert command[-2:] == ["congctl", "cubic"]
        assert "sysctl" not in command


def test_an_unknown_name_exits_2_before_any_namespace(monkeypatch, capsys):
    monkeypatch.setattr(bench_link, "missing_requirements", lambda: None)
    monkeypatch.setattr(bench_link, "_read", lambda path: "reno cubic")
    created = []
    monkeypatch.setattr(bench_link, "create_link", lambda *a: created.append(a))
    assert bench_link.main(["--congestion-control", "vegas", "--systems", "zero3"]) == 2
    assert created == []
    assert capsys.readouterr().err.strip().startswith("--congestion-control vegas:")
