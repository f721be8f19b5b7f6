"""Reading RUN_DIR/metrics.jsonl back: pure series and totals for ``zerorun report``.

The file is what the collector accepted, one record per line, each naming its rank (see
events.py for the kinds). A line that does not parse (a run killed mid-write) is skipped and
counted rather than failing the whole report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RankSeries:
    """One rank's history: times are seconds since the first record of the run."""

    host: str = "?"
    mem_label: str = "rss"
    mem_t: list[float] = field(default_factory=list)
    mem_bytes: list[float] = field(default_factory=list)
    mem_peak: float = 0.0
    comm: dict[str, list] = field(default_factory=dict)  # op -> [count, bytes, seconds]
    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    waited_s: list[float | None] = field(default_factory=list)  # Note [comm share] in recorder.py
    sent: list[tuple[int, int]] = field(default_factory=list)  # (within, between) per step: Note [bytes per link]
    samples: float = 0.0
    all_counted: bool = True  # every step said how many samples it took


@dataclass
class Metrics:
    ranks: dict[int, RankSeries]
    skipped_lines: int = 0
    duration_s: float = 0.0


def load_records(path: Path) -> tuple[list[dict], int]:
    """The parseable records of a metrics file and how many lines were skipped."""
    records, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("rank"), int) and isinstance(record.get("t"), (int, float)):
                records.append(record)
            else:
                skipped += 1
    return records, skipped


def summarize(records: list[dict], skipped: int = 0) -> Metrics:
    """Fold records into per-rank series (pure)."""
    if not records:
        return Metrics({}, skipped)
    t0 = min(r["t"] for r in records)
    ranks: dict[int, RankSeries] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        series = ranks.setdefault(r["rank"], RankSeries())
        series.host = r.get("host", series.host)
        kind = r.get("kind")
        if kind == "sample":
            mem = r.get("mem") or {}
            on_gpu = "cuda_allocated" in mem
            value = mem.get("cuda_allocated" if on_gpu else "rss")
            if value is not None:
                series.mem_label = "GPU allocated" if on_gpu else "RSS"
                series.mem_t.append(r["t"] - t0)
                series.mem_bytes.append(value)
                series.mem_peak = max(series.mem_peak, mem.get("cuda_peak" if on_gpu else "rss_peak") or value)
            for op, triple in (r.get("comm") or {}).items():
                totals = series.comm.setdefault(op, [0, 0, 0.0])
                for i in range(3):
                    totals[i] += triple[i]
        elif kind == "step" and isinstance(r.get("step"), int):  # the collector wrote it validated
            series.steps.append(r["step"])
            series.loss.append(r.get("loss"))
            series.step_time_s.append(r.get("step_time_s") or 0.0)
            series.waited_s.append(r.get("waited_s"))
            if r.get("sent_within") is not None and r.get("sent_between") is not None:
                series.sent.append((r["sent_within"], r["sent_between"]))
            if r.get("samples") is None:
                series.all_counted = False
            series.samples += r.get("samples") or 0
    return Metrics(dict(sorted(ranks.items())), skipped, max(r["t"] for r in records) - t0)


def comm_ops(metrics: Metrics) -> list[str]:
    return sorted({op for s in metrics.ranks.values() for op in s.comm})


def throughput(series: RankSeries) -> float | None:
    """Samples per second of training time (every step's samples over the sum of step times),
    None unless every step counted its samples: the end-of-run summary's figure
    (collector.RankView.run_samples_per_s), from the same records."""
    busy = sum(series.step_time_s)
    return series.samples / busy if series.all_counted and series.samples and busy > 0 else None


def mean_last_loss(metrics: Metrics) -> tuple[int, float] | None:
    """(step, the ranks' own losses at it averaged) for the last step every rank reported a loss for."""
    per_rank = [{st: lo for st, lo in zip(s.steps, s.loss, strict=True) if lo is not None} for s in metrics.ranks.values()]
    if not per_rank:
        return None
    common = set.intersection(*(set(losses) for losses in per_rank))
    if not common:
        return None
    step = max(common)
    return step, sum(losses[step] for losses in per_rank) / len(per_rank)


def comm_share(series: RankSeries) -> float | None:
    """The share of step time the rank waited for communication over the run (the summary's)."""
    from zerorun.telemetry.collector import comm_fraction

    return comm_fraction(list(zip(series.step_time_s, series.waited_s, strict=True)))


def sent_per_step(series: RankSeries) -> tuple[float, float] | None:
    """Bytes the rank sent per step (within its host, to other hosts), medians over the run: the
    summary's figure (collector.sent_per_step), from the same records."""
    from zerorun.telemetry.collector import sent_per_step as median_sent

    return median_sent(series.sent)
