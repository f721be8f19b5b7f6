"""Imported by scripts/model_zoo.py: the zoo's table, from outcomes just run or from the logs
of runs already done.

    python scripts/model_zoo.py --fine --resume /tmp/zerorun-model-zoo/1234 [--no-run]

Each world's rank 0 logs a line per finished family (``rank0-*.jsonl``) and ``run_zoo`` adds a
line to ``crashes.jsonl`` for a family that took its world down, so a set run in parts (by
``--setting``, by ``--only``, or cut short and resumed) still gives one table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def summary(outcomes: Iterable) -> dict[str, int]:
    outcomes = list(outcomes)
    counts = {"tried": len(outcomes)}
    for status in ("passed", "failed", "skipped"):
        counts[status] = sum(o.status == status for o in outcomes)
    counts["built"] = counts["passed"] + counts["failed"]
    return counts


def logged_records(directories: Iterable[Path]) -> list[dict]:
    """Every outcome logged under ``directories`` (at any depth), one per (family, stage,
    setting): a later directory's replaces an earlier one's (a row re-run after a fix)."""
    files = [f for d in directories
             for f in sorted((f for pattern in ("rank0-*.jsonl", "crashes.jsonl") for f in Path(d).rglob(pattern)),
                             key=lambda f: f.stat().st_mtime)]
    found: dict[tuple, dict] = {}
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "status" in record:
                found[(record["family"], record["stage"], record.get("setting", ""))] = record
    return list(found.values())


def write_table(outcomes: list, path: Path, title: str, intro: str) -> None:
    """``title``, ``intro``, then a section per (stage, setting), stage 3 first: the counts and
    a row per family, failures first."""
    by_stage: dict[tuple[int, str], list] = {}
    for outcome in outcomes:
        by_stage.setdefault((outcome.stage, outcome.setting), []).append(outcome)
    lines = [f"# {title}", "", intro, ""]
    for (stage, setting), group in sorted(by_stage.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        counts = summary(group)
        share = counts["passed"] / counts["built"] if counts["built"] else 0.0
        lines += [f"## Stage {stage}" + (f", {setting}" if setting else ""), "",
                  f"{counts['tried']} families tried, {counts['built']} built and trainable by plain torch, "
                  f"**{counts['passed']} passed** ({share:.1%} of those), {counts['failed']} failed, "
                  f"{counts['skipped']} skipped.", "",
                  "| family | result | detail |", "|---|---|---|"]
        order = {"failed": 0, "passed": 1, "skipped": 2}
        for o in sorted(group, key=lambda o: (order[o.status], o.family)):
            detail = o.detail.replace("|", "\\|")
            lines.append(f"| {o.family} | {o.status} | {detail} |")
        lines.append("")
    path.write_text("\n".join(lines))


def overview(outcomes: list) -> list[str]:
    """A markdown table of the counts per setting, for the top of the fine set's page."""
    settings = sorted({(o.stage, o.setting) for o in outcomes}, key=lambda k: (-k[0], k[1]))
    lines = ["| stage, setting | tried | built | passed | failed | skipped |", "|---|---|---|---|---|---|"]
    for stage, setting in settings:
        c = summary(o for o in outcomes if (o.stage, o.setting) == (stage, setting))
        lines.append(f"| {stage}, {setting or 'default'} | {c['tried']} | {c['built']} | {c['passed']} | "
                     f"{c['failed']} | {c['skipped']} |")
    return lines
