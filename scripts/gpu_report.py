"""python scripts/gpu_report.py RESULTS_DIR

The one table of scripts/gpu_check.sh, from what its steps left in RESULTS_DIR: the cuda tier's
JUnit file (cuda.xml: parity, the findings of issues 32 and 41, one GPU, memory), the memory
test's figures (memory.json) and scripts/bench_gpu.py's (bench.json: per system step time,
TFLOPS, peak allocated and reserved GPU memory and host memory, as ratios against FSDP2 in the
same run). Printed as a Markdown table, ready for docs/benchmarks.md;
a missing file is a row that says so.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

GROUPS = {"test_cuda_parity": "parity (stages 0-3, fp32/bf16, offload none/cpu/nvme, world 1 and 2)",
          "test_cuda_findings": "issue 32 and 41 findings (device, backend, checkpoints, telemetry, RNG, seed, exit)",
          "test_cuda_one_gpu": "one GPU: NCCL at world 1, zerorun --gpus 1, HF checkpointing, pinned offload",
          "test_cuda_memory": "stage-3 GPU peak against FSDP2"}


def test_rows(path: Path) -> list[tuple[str, str, str]]:
    if not path.is_file():
        return [("cuda tier", "not run", f"{path.name} missing")]
    counts: dict[str, dict[str, int]] = {}
    failed: list[str] = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        group = case.get("classname", "").split(".")[-1]
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        counts.setdefault(group, {"passed": 0, "failed": 0, "skipped": 0})[outcome] += 1
        if outcome == "failed":
            failed.append(case.get("name", "?"))
    rows = []
    for group, tally in sorted(counts.items()):
        verdict = "FAIL" if tally["failed"] else "pass" if tally["passed"] else "skipped"
        detail = ", ".join(f"{n} {k}" for k, n in tally.items() if n)
        rows.append((GROUPS.get(group, group), verdict, detail))
    if failed:
        rows.append(("failed tests", "FAIL", ", ".join(failed[:12]) + (" ..." if len(failed) > 12 else "")))
    return rows


def memory_rows(path: Path) -> list[tuple[str, str, str]]:
    if not path.is_file():
        return [("GPU peak, 34M MLP: zerorun stage 3 / FSDP2", "not measured", f"{path.name} missing")]
    found = json.loads(path.read_text())
    gib = {s: found[s]["peak"] / 2**30 for s in ("zero3", "fsdp2")}
    verdict = "pass" if found["ratio"] <= found["bound"] else "FAIL"
    return [("GPU peak, 34M MLP: zerorun stage 3 / FSDP2", verdict,
             f"{found['ratio']:.2f}x ({gib['zero3']:.2f} / {gib['fsdp2']:.2f} GiB; bound {found['bound']}x)")]


def bench_rows(path: Path) -> list[tuple[str, str, str]]:
    """A row per system: median step, model TFLOPS, peak allocated and reserved GPU memory, peak
    host memory, each with its ratio against FSDP2; the verdict against issue 41's goals (stage 3
    no slower and no larger in reserved memory than FSDP2, stage 2 + offload <= 0.6x DeepSpeed's
    ZeRO-Offload step)."""
    if not path.is_file():
        return [("bench_gpu.py", "not run", f"{path.name} missing")]
    found = json.loads(path.read_text())
    preset = found.get("options", {}).get("preset", "?")
    by_system = {r["system"]: r for r in rows(found["results"])}
    out = []
    for system, row in by_system.items():
        name = f"bench {system} ({preset})"
        if row.get("status") != "ok":
            out.append((name, "not installed" if row.get("status") == "not installed" else "FAIL", row.get("error", "")))
            continue
        out.append((name, _verdict(system, row, by_system), _figures(row)))
    return out


def rows(results: list[dict]) -> list[dict]:
    """Each system's figures and their ratios against FSDP2 in the same run (pure)."""
    base = next((r for r in results if r["system"] == "fsdp2" and r.get("status") == "ok"), None)
    out = []
    for r in results:
        row = dict(r)
        if r.get("status") == "ok":
            row["tflops"] = 6 * r["params"] * r["tokens_per_step"] / r["step_s"] / 1e12
            for key in ("step_s", "gpu_peak_gib", "gpu_reserved_gib", "host_peak_gib"):
                value, peer = r.get(key), (base or {}).get(key)
                row[f"{key}_x"] = value / peer if value and peer else None
        out.append(row)
    return out


def _x(value) -> str:
    return "" if value is None else f" ({value:.2f}x)"


def _gib(value) -> str:
    return "-" if value is None else f"{value:.2f} GiB"


def _figures(row: dict) -> str:
    return (f"{row['step_s']:.3f} s/step{_x(row.get('step_s_x'))}, {row['tflops']:.3g} TFLOPS, "
            f"GPU alloc {_gib(row.get('gpu_peak_gib'))}{_x(row.get('gpu_peak_gib_x'))}, "
            f"reserved {_gib(row.get('gpu_reserved_gib'))}{_x(row.get('gpu_reserved_gib_x'))}, "
            f"host {_gib(row.get('host_peak_gib'))}{_x(row.get('host_peak_gib_x'))}")


def _verdict(system: str, row: dict, by_system: dict) -> str:
    if system == "zero3":
        step, reserved = row.get("step_s_x"), row.get("gpu_reserved_gib_x")
        if step is None:
            return "ok (no FSDP2 figure)"
        missed = [what for what, x in (("step", step), ("reserved", reserved)) if x is not None and x > 1.0]
        return "ok" if not missed else "ok, over goal: " + ", ".join(missed)
    peer = by_system.get("ds2+cpu", {})
    if system == "zero2+cpu" and peer.get("status") == "ok":
        ratio = row["step_s"] / peer["step_s"]
        return f"ok ({ratio:.2f}x DeepSpeed{', over goal 0.6x' if ratio > 0.6 else ''})"
    return "ok"


def render(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| check | result | figures |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/gpu_report.py RESULTS_DIR (the directory gpu_check.sh wrote)", file=sys.stderr)
        return 2
    results = Path(argv[0])
    rows = test_rows(results / "cuda.xml") + memory_rows(results / "memory.json") + bench_rows(results / "bench.json")
    print(render(rows))
    return 1 if any(verdict == "FAIL" for _, verdict, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
