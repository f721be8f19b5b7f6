"""The bytes each rank sends per optimizer step, between hosts and within one, and the link time
they imply (pure); ``zerorun estimate --link 300Mbit`` prints them.

Symbols as in memory.py: Ψ parameters, p bytes per parameter (4 in fp32, 2 in bf16/fp16), N
ranks, G ranks per host, H = N / G hosts. A ring collective over a buffer of B bytes has every
rank send (N-1)/N B for a reduce-scatter or an all-gather and twice that for an all-reduce
(gloo's ring, and zerorun's comm/ring.py). Per step, what zerorun issues:

    stage 0 (and DDP)   all-reduce of the gradients                      2 (N-1)/N pΨ
    stage 1             reduce-scatter of the gradients at the boundary
                        + all-gather of the updated parameters           2 (N-1)/N pΨ
    stage 2             reduce-scatter + all-gather                      2 (N-1)/N pΨ
    stage 3             all-gather in forward and in backward +
                        reduce-scatter                                   (N-1)/N p(3Ψ - K)

K: the elements of the unit forward uses last, which stays gathered into backward, where it is
used first (zero.max_reuse_distance): a transformer's output head, V x h (tied or not; a tied
head's unit is the embedding's). Known from the shape (--preset, --hf-config); 0 otherwise, an
upper bound. With a prefetch budget (zero.prefetch_bucket_size), backward's first units within
it stay gathered from their forward too (Note [forward runs on into backward] in
zero/gather_prefetch.py): K grows by up to that many elements (whole units: a little less).

hpZ (ZeRO++'s secondary copies, partition size h): backward's all-gathers stay within the host,
(h-1)/h p(Ψ - K), and the reduce-scatter runs within the host then across (_hpz_traffic below).

ZeRO++ (Note [quantized collectives] in zero/comm/quantized_collectives.py): qwZ's gathers move
int8 codes and an fp32 scale per block of b elements, q = 1 + 4/b bytes per element instead of
p; qgZ's reduce-scatter sends each other rank its chunk in the same form, point to point.

Where the bytes go: ranks are numbered host by host, so a ring crosses hosts on H of its N
edges; a rank's ring traffic is on the link in that share, H/N, on average. qgZ's exchange
sends to every other rank directly: (N-G)/(N-1) of it leaves the host. The link time of a step
is one host's link bytes, G ranks' worth, over the rate; the estimate counts payload, and a
link also carries Ethernet, IP and TCP headers and acknowledgements (about 1% measured with
64 KiB segments: docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerorun.errors import PlannerError
from zerorun.planner.memory import Job

# (label, qwZ, qgZ) per stage: the options each stage can take (config/rules.py)
OPTIONS = {0: (("", False, False),), 1: (("", False, False),),
           2: (("", False, False), ("+qgz", False, True)),
           3: (("", False, False), ("+qwz", True, False), ("+qgz", False, True), ("+qwz+qgz", True, True))}


@dataclass(frozen=True)
class Traffic:
    label: str  # "stage 3+qwz"
    stage: int
    link_bytes: float  # per rank per step, to other hosts
    local_bytes: float  # per rank per step, to ranks of its own host

    def link_seconds(self, rate_bps: float, ranks_per_host: int) -> float:
        """One host's link bytes per step over the rate: the step's lower bound from the link."""
        return self.link_bytes * ranks_per_host * 8 / rate_bps


def step_traffic(num_params: int, job: Job, stage: int, param_bytes: int, *, qwz: bool = False,
                 qgz: bool = False, block: int = 2048, kept: int = 0, hpz: int = 1,
                 trained: int | None = None) -> Traffic:
    """``trained``: the parameters that train (default all): only their gradients are reduced
    and, at stages 1-2, only they are gathered after the update; stage 3 gathers every
    parameter, frozen ones too (Note [frozen units] in zero/unit/partition.py)."""
    n, g = job.world_size, job.gpus_per_node
    hosts = max(1, n // g)
    quantized = 1 + 4 / block  # bytes per element on the wire, Note [packed layout] in comm/quantize.py
    trained = num_params if trained is None else trained
    ring = (n - 1) / n * trained  # elements one rank sends in one ring reduce-scatter or all-gather of them
    if stage == 3 and hpz > 1:
        return _hpz_traffic(num_params, job, param_bytes, qwz=qwz, qgz=qgz, quantized=quantized, kept=kept, hpz=hpz,
                            trained=trained)
    if stage == 0:
        ring_bytes, exchange_bytes = 2 * ring * param_bytes, 0.0
    elif stage == 1:  # Note [scatter in place] in zero/grad_reduce.py
        ring_bytes, exchange_bytes = 2 * ring * param_bytes, 0.0
    elif stage == 2:
        gather = ring * param_bytes
        ring_bytes, exchange_bytes = (gather, ring * quantized) if qgz else (2 * gather, 0.0)
    elif stage == 3:
        gathers = (n - 1) / n * (2 * num_params - kept) * (quantized if qwz else param_bytes)
        ring_bytes, exchange_bytes = (gathers, ring * quantized) if qgz else (gathers + ring * param_bytes, 0.0)
    else:
        raise PlannerError(f"no ZeRO stage {stage}", hint="stages are 0, 1, 2 and 3")
    ring_link = hosts / n if hosts > 1 else 0.0
    exchange_link = (n - g) / (n - 1) if n > 1 else 0.0
    link = ring_bytes * ring_link + exchange_bytes * exchange_link
    label = f"stage {stage}" + next(name for name, w, q in OPTIONS[stage] if (w, q) == (qwz, qgz))
    return Traffic(label, stage, link, ring_bytes + exchange_bytes - link)


def _hpz_traffic(num_params: int, job: Job, p: int, *, qwz: bool, qgz: bool, quantized: float, kept: int,
                 hpz: int, trained: int) -> Traffic:
    """Stage 3 with hpZ (Note [secondary copy] in zero/unit/secondary.py): forward's all-gather
    over the world ring as without it; backward's, Ψ - K elements exact in the gather dtype,
    over the host group of h = hpz ranks, within the host: (h-1)/h p(Ψ - K); the reduce-scatter
    with qgZ the same exchange, else in two (Note [hierarchical reduce-scatter] in
    comm/quantized_collectives.py): (h-1)/h pΨ within the host, then over the A = N/h ranks of this local
    index, one per host group, a ring sending (A-1)/A pΨ/h of which H/A crosses hosts."""
    n, g = job.world_size, job.gpus_per_node
    hosts = max(1, n // g)
    ring_link = hosts / n if hosts > 1 else 0.0
    forward = (n - 1) / n * num_params * (quantized if qwz else p)
    backward = (hpz - 1) / hpz * (num_params - kept) * p
    link, local = forward * ring_link, forward * (1 - ring_link) + backward
    if qgz:
        exchange = (n - 1) / n * trained * quantized
        share = (n - g) / (n - 1)
        link, local = link + exchange * share, local + exchange * (1 - share)
    else:
        across = n // hpz
        local += (hpz - 1) / hpz * trained * p
        if across > 1:
            second = (across - 1) / across * trained / hpz * p
            share = hosts / across if hosts > 1 else 0.0
            link, local = link + second * share, local + second * (1 - share)
    label = "stage 3" + next(name for name, w, q in OPTIONS[3] if (w, q) == (qwz, qgz)) + "+hpz"
    return Traffic(label, 3, link, local)


def all_traffic(num_params: int, job: Job, param_bytes: int, block: int = 2048, kept: int = 0,
                trained: int | None = None) -> list[Traffic]:
    """Every stage and option; hpZ rows (its partition size the ranks per host) when there are
    several hosts of several ranks."""
    rows = [step_traffic(num_params, job, stage, param_bytes, qwz=qwz, qgz=qgz, block=block, kept=kept, trained=trained)
            for stage, options in OPTIONS.items() for _, qwz, qgz in options]
    g = job.gpus_per_node
    if g > 1 and job.world_size > g and job.world_size % g == 0:
        rows += [step_traffic(num_params, job, 3, param_bytes, qwz=qwz, qgz=qgz, block=block, kept=kept, hpz=g,
                              trained=trained) for qwz, qgz in ((False, False), (True, True))]
    return rows


def kept_numel(shape, prefetch_elements: int = 0, num_params: int = 0) -> int:
    """K above from a TransformerShape (or None: 0, unknown), and the prefetch budget's share."""
    head = 0 if shape is None else shape.vocab * shape.hidden
    return head + max(0, min(prefetch_elements, num_params - head))


def parse_rate(text: str) -> float:
    """'300Mbit', '1gbit', '10Gbit/s' -> bits per second (decimal units, as tc and NICs count)."""
    raw = text.strip().lower().removesuffix("/s")
    for suffix, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if raw.endswith(suffix):
            try:
                value = float(raw[: -len(suffix)])
            except ValueError:
                break
            if value > 0:
                return value * factor
            break
    raise PlannerError(f"link rate {text!r} is not a rate", hint="write it like 300Mbit, 1Gbit or 25Gbit")
