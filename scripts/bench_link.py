"""sudo python scripts/bench_link.py [--rates 300mbit,1gbit] [--ranks-per-host 1] [--steps 6] [--congestion-control cubic] [--json out.json]

Data parallelism across two simulated hosts: each "host" is a network namespace, the two joined
by a veth pair whose both ends are shaped by a token bucket (``tc ... tbf``; this kernel has no
netem), so every byte between hosts crosses a link of the given rate while ranks on one host talk
over that namespace's loopback. Root and iproute2 (``ip``, ``tc``) are needed; without them the
script says so in one line and exits 2. TCP between the hosts runs the congestion control
``--congestion-control`` names (default cubic, Linux's own default), set on the link's route in
each namespace, so the machine's own setting is untouched; ``host`` keeps the machine's. This
matters: on a machine whose default is BBR, BBR paced the link's flows below the token bucket's
rate whenever the ranks computed (zerorun stage 3's transfers 4-15% slower than the rate
allows; docs/benchmarks.md).

Peers in one run, on the 33.7M-parameter GPT of examples/gpt.py in fp32 (the model and the
systems of scripts/bench_cpu.py): torch DDP, FSDP2 and zerorun stages 1-3, and zerorun stage 3
with ZeRO++'s quantized weights (``+qwz``), quantized gradients (``+qgz``) or both, with hpZ
(``+hpz``: secondary copies partitioned over each host's ranks, for --ranks-per-host 2 and up),
and with the tied embedding's lookup gradient sent as rows (``+rows``:
``zero.tied_embedding_rows``). Per system and rate:

  step s      median over the timed steps of the slowest rank's step (with --repeats N, every
              system runs N times at each rate, interleaved, and this is the median of the runs')
  link MB     bytes one rank sends per step to the other host: the namespace's veth transmit
              counter over the timed steps (Ethernet, IP and TCP headers included) / ranks per
              host / steps
  local MB    the same over the namespace's loopback (ranks of one host; 0 for 1 rank a host)
  zr link MB  zerorun's own figure for the same steps, payload only: what its collectives said
              each rank sent to the other host (Note [link classes] in zerorun/zero/comm/
              link_split.py; the dashboard's, the summary's and ``zerorun report``'s sent/step),
              mean over the ranks; '-' for DDP and FSDP2
  link s      the link-time bound: one host's link bytes per step / rate
  compute s   the same system's step with both hosts' ranks in one namespace, no shaping
  loss        the last step's loss on rank 0

Every system runs in fresh processes (one per rank, in its namespace, one torch thread each),
with the same initial weights and global batches. zerorun runs with ZERORUN_HOST_CHANNEL=0:
its shared-memory channel would carry bytes between namespaces of one machine and bypass the
link. The namespaces (``zrl<pid>h0``, ``zrl<pid>h1``) and the veth pair are deleted by name at
the end of the run, also when it fails or is interrupted; rank processes run in their own
process groups and are ended by their ids.

    sudo python scripts/bench_link.py --preset tiny --steps 2 --warmup 1 --rates 300mbit   # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

SYSTEMS = ("ddp", "fsdp2", "zero1", "zero2", "zero3", "zero3+rows", "zero3+qwz", "zero3+qgz", "zero3+qwz+qgz",
           "zero3+hpz")
SUBNET = "10.231.{}.{}"
RANK_TIMEOUT_S = 1800


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def missing_requirements() -> str | None:
    if os.geteuid() != 0:
        return "bench_link.py needs root (network namespaces and tc); run it with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"bench_link.py needs iproute2 ({', '.join(missing)} not found): apt-get install -y iproute2"
    return None


# --- the simulated hosts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """Two namespaces joined by a veth pair; names carry this process's id so nothing else's is touched."""

    tag: str

    @property
    def namespaces(self) -> tuple[str, str]:
        return f"{self.tag}h0", f"{self.tag}h1"

    @property
    def interfaces(self) -> tuple[str, str]:
        return f"{self.tag}a", f"{self.tag}b"

    def address(self, host: int) -> str:
        return SUBNET.format(os.getpid() % 250, host + 1)

    @property
    def subnet(self) -> str:
        return SUBNET.format(os.getpid() % 250, 0) + "/24"


HOST_CONGESTION = "host"  # --congestion-control: the machine's own default


def congestion_problem(name: str, available: str) -> str | None:
    """Pure: why ``name`` cannot be the link's congestion control, given the kernel's
    tcp_available_congestion_control; None when it can."""
    if name == HOST_CONGESTION or name in available.split():
        return None
    return (f"--congestion-control {name}: this kernel has no such TCP congestion control (available: "
            f"{available.strip() or 'none listed'}); name one of them, or '{HOST_CONGESTION}' for the machine's default")


def route_command(link: Link, host: int, congestion: str) -> list[str]:
    """The command that gives the link's route in ``host``'s namespace its congestion control:
    a route attribute, so neither the machine's default nor its list of congestion controls
    allowed in namespaces changes."""
    ns, iface = link.namespaces[host], link.interfaces[host]
    return ["ip", "-n", ns, "route", "change", link.subnet, "dev", iface, "proto", "kernel", "scope", "link",
            "src", link.address(host), "congctl", congestion]


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def create_link(link: Link, congestion: str = HOST_CONGESTION) -> None:
    (ns0, ns1), (if0, if1) = link.namespaces, link.interfaces
    for ns in (ns0, ns1):
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    _sh("ip", "link", "add", if0, "type", "veth", "peer", "name", if1)
    for host, (ns, iface) in enumerate(((ns0, if0), (ns1, if1))):
        _sh("ip", "link", "set", iface, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{link.address(host)}/24", "dev", iface)
        _sh("ip", "-n", ns, "link", "set", iface, "up")
        if congestion != HOST_CONGESTION:
            _sh(*route_command(link, host, congestion))


def shape(link: Link, rate_bps: float | None) -> None:
    """Replace each end's root qdisc: a token bucket at ``rate_bps``, or none (unshaped)."""
    for ns, iface in zip(link.namespaces, link.interfaces, strict=True):
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", iface, "root"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # absent the first time
        if rate_bps is not None:
            # burst: 4 ms of the rate (at least 64 KiB, so a GSO super-packet passes whole);
            # latency: how long a packet may queue before tbf drops it (TCP backs off instead).
            burst = max(64 * 1024, int(rate_bps / 8 * 0.004))
            _sh("tc", "-n", ns, "qdisc", "add", "dev", iface, "root", "tbf",
                "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms")


def delete_link(link: Link) -> None:
    for ns in link.namespaces:  # deleting a namespace deletes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# --- one system's world --------------------------------------------------------------------------


@dataclass
class LinkResult:
    system: str
    rate: str
    step_s: float | None = None
    link_mb: float | None = None
    told_link_mb: float | None = None  # zerorun's own count of the same (payload only)
    local_mb: float | None = None
    link_s: float | None = None
    compute_s: float | None = None
    cpu_s: float | None = None  # a rank's CPU seconds (user + system, all its threads) per step
    compute_cpu_s: float | None = None  # the same in the one-host run
    last_loss: float | None = None
    error: str | None = None


def _link_result(system: str, rate_name: str, rate: float, runs: list[dict], compute_s: float | None,
                 per_host: int, compute_cpu_s: float | None = None) -> LinkResult:
    """One row from a system's runs at one rate (--repeats): the median of their step times and
    CPU times, their bytes averaged; a failed run fails the row."""
    failed = next((out["error"] for out in runs if "error" in out), None)
    if failed is not None:
        return LinkResult(system, rate_name, error=failed)
    link_bytes = statistics.mean(out["link_bytes"] for out in runs)
    told = [out["told_link_bytes"] for out in runs if out["told_link_bytes"] is not None]
    return LinkResult(
        system, rate_name, step_s=statistics.median(out["step_s"] for out in runs), link_mb=link_bytes / 1e6,
        told_link_mb=statistics.mean(told) / 1e6 if told else None,
        local_mb=statistics.mean(out["local_bytes"] for out in runs) / 1e6, link_s=link_bytes * per_host * 8 / rate,
        compute_s=compute_s, cpu_s=statistics.median(out["cpu_s"] for out in runs), compute_cpu_s=compute_cpu_s,
        last_loss=runs[-1]["last_loss"])


def run_world(link: Link, system: str, options: dict, hosts: int, per_host: int, one_host: bool,
              workdir: Path) -> dict:
    """Start every rank (in its namespace), wait for all; a summary dict or {'error': ...}."""
    world = hosts * per_host
    run_dir = Path(tempfile.mkdtemp(prefix=f"{system.replace('+', '_')}-", dir=workdir))
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world):
            host = 0 if one_host else rank // per_host
            ns, iface = link.namespaces[host], link.interfaces[host]
            env = dict(os.environ, PYTHONPATH=str(HERE.parent), GLOO_SOCKET_IFNAME=iface,
                       ZERORUN_HOST_CHANNEL="0", OMP_NUM_THREADS="1",
                       ZERORUN_HOST_SLOTS=str(world) if one_host else ",".join([str(per_host)] * hosts))
            spec = {**options, "system": system, "rank": rank, "world": world, "iface": iface, "per_host": per_host,
                    "counts": rank % per_host == 0 if not one_host else rank == 0,
                    "init_file": str(run_dir / "rendezvous"), "out": str(run_dir / f"rank{rank}.json")}
            argv = ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()), "--rank-spec", json.dumps(spec)]
            log = open(run_dir / f"rank{rank}.log", "wb")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:  # each rank leads its own process group: end exactly those
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        lines = (run_dir / f"rank{failed[0]}.log").read_text(errors="replace").strip().splitlines()
        return {"error": f"rank {failed[0]}: {lines[-1] if lines else 'no output'}"[:200]}
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)]
    steps = len(ranks[0]["step_times_s"])
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(steps)]
    counted = [r for r in ranks if r["counters"] is not None]
    link_bytes = statistics.mean(r["counters"]["link"] for r in counted) / per_host / steps
    local_bytes = statistics.mean(r["counters"]["local"] for r in counted) / per_host / steps
    told = [r["sent"] for r in ranks if r.get("sent") is not None]
    told_link = statistics.mean(between for _, between in told) / steps if told else None
    return {"step_s": statistics.median(per_step), "link_bytes": link_bytes, "local_bytes": local_bytes,
            "told_link_bytes": told_link, "last_loss": ranks[0]["losses"][-1],
            "cpu_s": statistics.mean(r["cpu_s"] for r in ranks)}


class SentCounter:
    """What zerorun's collectives say this rank sent, [within, between] (the recorder's figures)."""

    def __init__(self):
        self.sent = [0, 0]

    def collective_started(self, seq, op, nbytes):
        pass

    def collective_finished(self, seq, op, nbytes, seconds, waited):
        pass

    def collective_sent(self, seq, op, within, between):
        self.sent[0] += within
        self.sent[1] += between


class Timeline:
    """--trace: each collective's issue and completion and each step's phase ends, in seconds
    since the step began (for reading where the link or the compute waits)."""

    def __init__(self):
        self.step_started = time.perf_counter()
        self.steps: list[list] = []

    def begin_step(self) -> None:
        self.step_started = time.perf_counter()
        self.steps.append([[0.0, "clock", self.step_started]])  # CLOCK_MONOTONIC: one clock for every rank

    def mark(self, *event) -> None:
        if self.steps:
            self.steps[-1].append([round(time.perf_counter() - self.step_started, 4), *event])

    def collective_started(self, seq, op, nbytes):
        self.mark("issue", seq, op, nbytes)

    def collective_finished(self, seq, op, nbytes, seconds, waited):
        self.mark("done", seq, op, nbytes, round(waited, 4))

    def collective_sent(self, seq, op, within, between):
        pass


def rank_main(spec: dict) -> None:
    """One rank, inside its namespace: warmup, barrier, counters, timed steps, barrier, counters."""
    import torch
    import torch.distributed as dist
    from bench_systems import build_trainer
    from gpt import GPT, Block, preset, rank_slice, synthetic_batch

    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    dist.init_process_group("gloo", init_method=f"file://{spec['init_file']}", rank=rank, world_size=world)
    cfg = preset(spec["preset"])
    torch.manual_seed(0)
    config = spec["zerorun_config"]
    if "+hpz" in spec["system"]:  # ZeRO++ hpZ: the secondary copies partitioned over each host's ranks
        config = {**config, "zero": {**config.get("zero", {}), "hpz_partition_size": spec["per_host"]}}
    trainer = build_trainer(spec["system"], GPT(cfg), lr=1e-4, block_class=Block, zerorun_config=config)

    def counters() -> dict[str, int]:
        def read(iface: str) -> int:
            return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
        return {"link": read(spec["iface"]), "local": read("lo")} if spec["counts"] else {}

    counter = SentCounter()
    if spec["system"].startswith("zero"):
        from zerorun.zero.comm import collectives

        collectives.add_observer(counter)
    timeline = Timeline() if spec.get("trace") else None
    if timeline is not None and spec["system"].startswith("zero"):
        collectives.add_observer(timeline)
        _mark_ring_transfers(timeline)
        trainer.step = _phases_marked(trainer, timeline)
    times, losses = [], []
    before: dict[str, int] = {}
    told_before = [0, 0]
    cpu_before = 0.0
    for step in range(spec["warmup"] + spec["steps"]):
        if step == spec["warmup"]:
            dist.barrier()
            before = counters()
            told_before = list(counter.sent)
            cpu_before = _cpu_seconds()
        tokens, targets = synthetic_batch(cfg, spec["micro_batch"] * world, step=step)
        if timeline is not None:
            timeline.begin_step()
        started = time.perf_counter()
        loss = trainer.step(rank_slice(tokens, rank, world), rank_slice(targets, rank, world))
        elapsed = time.perf_counter() - started
        if step >= spec["warmup"]:
            times.append(elapsed)
        losses.append(loss.item())
    cpu_per_step = (_cpu_seconds() - cpu_before) / spec["steps"]
    dist.barrier()
    after = counters()
    sent = {k: after[k] - before[k] for k in after} if spec["counts"] else None
    told = [counter.sent[0] - told_before[0], counter.sent[1] - told_before[1]] if spec["system"].startswith("zero") else None
    Path(spec["out"]).write_text(json.dumps({"step_times_s": times, "losses": losses, "counters": sent, "sent": told,
                                             "cpu_s": cpu_per_step}))
    if timeline is not None:
        Path(spec["trace"], f"{spec['tag']}-rank{rank}.json").write_text(json.dumps(timeline.steps))
    dist.destroy_process_group()


def _cpu_seconds() -> float:
    """This process's CPU time, every thread (the model's, gloo's, the ring driver's), user and
    system. The kernel's TCP work lands here too when it runs in the rank's context (its sends,
    and the softirqs a tick finds on its core): with one core per rank, a step whose CPU time is
    near its wall time is bound by the core, whatever the link leaves idle."""
    times = os.times()
    return times.user + times.system


def _mark_ring_transfers(timeline: Timeline) -> None:
    """--trace: when each collective between hosts starts to send its bytes (its headers
    matched) and when the ring driver finishes it (Note [ring progress])."""
    from zerorun.zero.comm import ring_driver

    check, finish = ring_driver.RingDriver._check, ring_driver.Job.finish

    def checked(driver, posted):
        check(driver, posted)
        timeline.mark("send", posted.job.seq)

    def finished(job):
        timeline.mark("moved", job.seq)
        finish(job)

    ring_driver.RingDriver._check = checked
    ring_driver.Job.finish = finished


def _phases_marked(trainer, timeline: Timeline):
    """The zerorun trainer's step with its forward, backward and update ends marked (--trace)."""
    def step(tokens, targets):
        loss = trainer.call(trainer.engine, tokens, targets)
        timeline.mark("forward")
        trainer.engine.backward(loss)
        timeline.mark("backward")
        trainer.engine.step()
        timeline.mark("step")
        return loss.detach()
    return step


# --- the run ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    from gpt import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="300mbit,1gbit", help="comma list of link rates (tc units)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each of the 2 hosts")
    parser.add_argument("--preset", default="bench", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every system per rate, interleaved; "
                        "the table gives the median of their step times")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    parser.add_argument("--no-compute", action="store_true", help="skip the one-host (unshaped) runs")
    parser.add_argument("--zerorun-config", default="{}", help="JSON merged into every zerorun config")
    parser.add_argument("--congestion-control", default="cubic", help="TCP congestion control between the "
                        f"hosts, set on the link's route (default cubic, Linux's default; '{HOST_CONGESTION}': the machine's)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    parser.add_argument("--trace", default=None, help="write each zerorun rank's timeline of collectives and "
                        "step phases here, one JSON file per rank, system and rate")
    args = parser.parse_args(argv)
    from bench_systems import parse_shared_options

    parse_shared_options(parser, args)
    from zerorun.errors import PlannerError
    from zerorun.planner.traffic import parse_rate

    try:
        args.rates = [(r.strip(), parse_rate(r)) for r in args.rates.split(",") if r.strip()]
    except PlannerError as err:
        parser.error(str(err))
    if min(args.steps, args.ranks_per_host, args.micro_batch, args.repeats) < 1 or args.warmup < 0:
        parser.error("--steps, --ranks-per-host, --micro-batch and --repeats must be >= 1, --warmup >= 0")
    return args


def render(results: list[LinkResult], per_host: int, load: str, congestion: str = HOST_CONGESTION):
    from rich.table import Table

    table = Table(title=f"2 hosts x {per_host} rank(s), fp32 GPT, TCP {congestion}; load average {load}")
    for header in ("rate", "system", "step s", "xDDP", "link MB", "xDDP", "zr link MB", "local MB", "link s",
                   "compute s", "step/max(link,compute)", "cpu s", "compute cpu s", "loss"):
        table.add_column(header, justify="left" if header in ("rate", "system") else "right", no_wrap=True)
    for r in results:
        if r.error:
            table.add_row(r.rate, r.system, *["-"] * 11, "failed: " + r.error[:60])
            continue
        ddp = next((d for d in results if d.rate == r.rate and d.system == "ddp" and d.error is None), None)
        bound = None if r.compute_s is None else max(r.link_s or 0.0, r.compute_s)  # --no-compute: no bound
        table.add_row(
            r.rate, r.system, f"{r.step_s:.2f}", _ratio(r.step_s, ddp.step_s if ddp else None),
            f"{r.link_mb:.1f}", _ratio(r.link_mb, ddp.link_mb if ddp else None),
            "-" if r.told_link_mb is None else f"{r.told_link_mb:.1f}", f"{r.local_mb:.1f}",
            f"{r.link_s:.2f}", _seconds(r.compute_s),
            _ratio(r.step_s, bound or None), _seconds(r.cpu_s), _seconds(r.compute_cpu_s), f"{r.last_loss:.4f}")
    return table


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value, base) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def main(argv=None) -> int:
    if "--rank-spec" in (argv if argv is not None else sys.argv):
        rank_main(json.loads((argv if argv is not None else sys.argv)[-1]))
        return 0
    args = parse_args(argv)
    problem = missing_requirements() or congestion_problem(
        args.congestion_control, _read("/proc/sys/net/ipv4/tcp_available_congestion_control"))
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console(width=190)
    options = {"preset": args.preset, "steps": args.steps, "warmup": args.warmup,
               "congestion_control": args.congestion_control,
               "micro_batch": args.micro_batch, "zerorun_config": args.zerorun_config,
               "trace": str(Path(args.trace).resolve()) if args.trace else None}
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    link = Link(tag=f"zrl{os.getpid()}")
    results: list[LinkResult] = []
    load_before = os.getloadavg()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below runs
    try:
        create_link(link, args.congestion_control)
        with tempfile.TemporaryDirectory(prefix="zerorun-link-") as workdir:
            compute: dict[str, dict] = {}
            if not args.no_compute:
                shape(link, None)
                for system in args.systems:
                    console.print(f"  one host, {system} ...", end=" ")
                    out = run_world(link, system, {**options, "tag": f"{system}-one-host"}, 2,
                                    args.ranks_per_host, True, Path(workdir))
                    if "error" not in out:
                        compute[system] = out
                    console.print(out.get("error") or f"{out['step_s']:.2f} s/step, {out['cpu_s']:.2f} CPU s")
            for rate_name, rate in args.rates:
                shape(link, rate)
                runs: dict[str, list[dict]] = {system: [] for system in args.systems}
                for repeat in range(args.repeats):  # interleaved: the machine's drift falls on every system
                    for system in args.systems:
                        console.print(f"  {rate_name}, {system}" + (f", run {repeat + 1}" if args.repeats > 1 else "")
                                      + " ...", end=" ")
                        tag = f"{system}-{rate_name}" + (f"-run{repeat + 1}" if args.repeats > 1 else "")
                        out = run_world(link, system, {**options, "tag": tag}, 2, args.ranks_per_host, False,
                                        Path(workdir))
                        runs[system].append(out)
                        console.print(out.get("error") or f"{out['step_s']:.2f} s/step, {out['cpu_s']:.2f} CPU s, "
                                      f"{out['link_bytes'] / 1e6:.1f} MB to the other host per rank")
                for system in args.systems:
                    one_host = compute.get(system, {})
                    results.append(_link_result(system, rate_name, rate, runs[system], one_host.get("step_s"),
                                                args.ranks_per_host, one_host.get("cpu_s")))
    finally:
        delete_link(link)
        signal.signal(signal.SIGTERM, previous)
    load = f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    console.print(render(results, args.ranks_per_host, load, args.congestion_control))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"options": {**options, "ranks_per_host": args.ranks_per_host, "rates": [r for r, _ in args.rates],
                         "load_average": load}, "results": [asdict(r) for r in results]}, indent=2))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
