"""Where ranks may run: hostfiles, --include/--exclude filters and Slurm's variables (pure).

Every function here is a pure function of text or a mapping, so it is fuzzed by
tests/unit/test_hostfile*.py. Malformed input raises ``HostfileError`` whose message names
the offending line or token; nothing here ever lets a ValueError/IndexError escape.

The grammar is DeepSpeed's, so existing hostfiles keep working:

    # comment
    worker-0 slots=4      # trailing comments are fine
    worker-1 slots=4

and filters are ``@``-separated host entries, each optionally narrowed to slot ids:
``worker-0:0,2@worker-1`` means slots 0 and 2 of worker-0 plus every slot of worker-1.
"""

from __future__ import annotations

from collections.abc import Mapping

from zerorun.errors import HostfileError
from zerorun.worker.slurm_env import MAX_HOSTS, check_host, expand_nodelist, expand_tasks_per_node

# Ordered host -> list of slot ids (slot ids are local device indices, 0..slots-1).
HostSlots = dict[str, list[int]]

# Bounds that no real cluster reaches, checked before anything is expanded (MAX_HOSTS: slurm_env.py).
MAX_SLOTS_PER_HOST = 1024
MAX_TOTAL_SLOTS = 1_000_000


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parse DeepSpeed-style hostfile text into an ordered ``{host: slots}`` mapping."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        fields = line.split()
        host = check_host(fields[0], where)
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise HostfileError(
                f"{where}: expected 'HOST slots=N', got {line!r}",
                hint="each non-comment line names one host and its slot count, e.g. 'worker-0 slots=4'",
            )
        count = fields[1][len("slots="):]
        if not count.isdigit() or int(count) < 1:
            raise HostfileError(f"{where}: slots must be a positive integer, got {count!r}")
        if int(count) > MAX_SLOTS_PER_HOST:
            raise HostfileError(f"{where}: slots={count} is more than {MAX_SLOTS_PER_HOST} workers on one host")
        if host in hosts:
            raise HostfileError(f"{where}: host {host!r} is listed twice")
        hosts[host] = int(count)
        if len(hosts) > MAX_HOSTS:
            raise HostfileError(f"{source} names more than {MAX_HOSTS:,} hosts")
    if not hosts:
        raise HostfileError(f"{source} names no hosts", hint="add lines like 'worker-0 slots=4'")
    return hosts


def parse_filter(spec: str, flag: str = "--include") -> dict[str, list[int] | None]:
    """Parse ``host[:slot,slot]@host...``; ``None`` slots means every slot of that host."""
    result: dict[str, list[int] | None] = {}
    if not spec.strip():
        raise HostfileError(f"{flag} is empty")
    for entry in spec.split("@"):
        where = f"{flag} entry {entry!r}"
        host, sep, slot_text = entry.partition(":")
        check_host(host, where)
        if host in result:
            raise HostfileError(f"{where}: host {host!r} appears twice")
        if not sep:
            result[host] = None
            continue
        slots: list[int] = []
        for token in slot_text.split(","):
            if not token.isdigit():
                raise HostfileError(f"{where}: slot {token!r} is not a non-negative integer")
            if int(token) in slots:
                raise HostfileError(f"{where}: slot {token} is listed twice")
            slots.append(int(token))
        result[host] = slots
    return result


def select_hosts(
    hosts: Mapping[str, int],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
) -> HostSlots:
    """Apply --include / --exclude / --num-nodes to a hostfile; returns the chosen slot ids."""
    if include and exclude:
        raise HostfileError("--include and --exclude cannot be used together")
    if sum(hosts.values()) > MAX_TOTAL_SLOTS:
        raise HostfileError(f"the hosts have more than {MAX_TOTAL_SLOTS:,} slots in all")
    chosen: HostSlots = {host: list(range(count)) for host, count in hosts.items()}
    if include:
        wanted = parse_filter(include, "--include")
        picked: HostSlots = {}
        for host, slots in wanted.items():
            if host not in chosen:
                raise HostfileError(f"--include names host {host!r}, which is not in the hostfile")
            _check_slots(host, slots, hosts[host], "--include")
            picked[host] = list(chosen[host]) if slots is None else sorted(slots)
        # Keep hostfile order so rank numbering does not depend on how the filter was typed.
        chosen = {host: picked[host] for host in chosen if host in picked}
    if exclude:
        unwanted = parse_filter(exclude, "--exclude")
        for host, slots in unwanted.items():
            if host not in chosen:
                raise HostfileError(f"--exclude names host {host!r}, which is not in the hostfile")
            _check_slots(host, slots, hosts[host], "--exclude")
            chosen[host] = [] if slots is None else [s for s in chosen[host] if s not in slots]
        chosen = {host: slots for host, slots in chosen.items() if slots}
    if num_nodes is not None:
        if num_nodes < 1:
            raise HostfileError(f"--num-nodes must be at least 1, got {num_nodes}")
        if num_nodes > len(chosen):
            raise HostfileError(f"--num-nodes {num_nodes} asks for more hosts than the {len(chosen)} available")
        chosen = dict(list(chosen.items())[:num_nodes])
    if not chosen:
        raise HostfileError("the host filters leave no slots to run on")
    return chosen


def _check_slots(host: str, slots: list[int] | None, count: int, flag: str) -> None:
    for slot in slots or []:
        if slot >= count:
            raise HostfileError(f"{flag}: slot {slot} of {host!r} does not exist (it has slots 0..{count - 1})")


def slurm_hosts(environ: Mapping[str, str]) -> dict[str, int] | None:
    """Hosts and slots from a Slurm allocation, or None outside one.

    Slots per node: SLURM_GPUS_ON_NODE when GPUs were allocated (one worker per GPU, like
    torchrun under Slurm), else SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE, else 1.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    nodes = expand_nodelist(nodelist)
    if environ.get("SLURM_GPUS_ON_NODE", "").isdigit() and int(environ["SLURM_GPUS_ON_NODE"]) > 0:
        counts = [int(environ["SLURM_GPUS_ON_NODE"])] * len(nodes)
    elif environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        counts = [int(environ["SLURM_NTASKS_PER_NODE"])] * len(nodes)
    elif environ.get("SLURM_TASKS_PER_NODE"):
        counts = expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"], len(nodes))
    else:
        counts = [1] * len(nodes)
    if any(count < 1 for count in counts):
        raise HostfileError("Slurm gives a node zero tasks")
    if any(count > MAX_SLOTS_PER_HOST for count in counts):
        raise HostfileError(f"Slurm gives a node more than {MAX_SLOTS_PER_HOST} tasks")
    if len(set(nodes)) != len(nodes):
        raise HostfileError(f"SLURM_JOB_NODELIST names a node twice: {nodelist!r}")
    return dict(zip(nodes, counts, strict=True))
