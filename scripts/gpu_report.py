"""python scripts/gpu_report.py RESULTS_DIR

The one table of scripts/gpu_check.sh, from what its steps left in RESULTS_DIR: the cuda tier's
JUnit file (cuda.xml: parity, the findings of issue 32, memory), the memory test's figures
(memory.json) and scripts/bench_gpu.py's (bench.json: step time and GPU peak per system, as
ratios against FSDP2 in the same run). Printed as a Markdown table, ready for docs/benchmarks.md;
a missing file is a row that says so.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

GROUPS = {"test_cuda_parity": "parity (stages 0-3, fp32/bf16, offload none/cpu/nvme, world 1 and 2)",
          "test_cuda_findings": "issue 32 findings (device, backend, checkpoints, telemetry, RNG)",
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
    if not path.is_file():
        return [("bench_gpu.py", "not run", f"{path.name} missing")]
    found = json.loads(path.read_text())
    results = {r["system"]: r for r in found["results"]}
    peer = results.get("fsdp2", {})
    rows = []
    for system, result in results.items():
        if result.get("error"):
            rows.append((f"bench {system}", "FAIL", result["error"]))
            continue
        step, peak = result.get("step_s"), result.get("gpu_peak_gib")
        ratio = f"{step / peer['step_s']:.2f}x FSDP2" if peer.get("step_s") and step else "no FSDP2 figure"
        memory = f", peak {peak:.1f} GiB" if peak else ""
        if peak and peer.get("gpu_peak_gib"):
            memory += f" ({peak / peer['gpu_peak_gib']:.2f}x)"
        verdict = "pass" if system == "fsdp2" or (peer.get("step_s") and step <= peer["step_s"]) else "slower"
        rows.append((f"bench {system} ({found['options'].get('preset', '?')})", verdict, f"{step:.3f} s/step, {ratio}{memory}"))
    return rows


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
