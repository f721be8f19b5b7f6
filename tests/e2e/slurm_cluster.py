"""A private Slurm cluster on this machine for the Slurm tests (used by test_slurm_jobs.py beside it).

    python tests/e2e/slurm_cluster.py DIR     # start one by hand, print its SLURM_CONF; Ctrl-C stops it

Debian's slurm-wlm (22.05) and munge, installed by ``scripts/setup.sh --test``. Everything lives
in one temporary directory: a munge key and socket, a slurm.conf naming two nodes n1 and n2
that are both this host (``NodeHostname=<this host> NodeAddr=127.0.0.1`` with distinct
``Port=``), and the state, spool, pid and log files. The daemons are started as root on free
ports (munged, with accounting mariadbd and slurmdbd, slurmctld, ``slurmd -N n1`` and ``slurmd
-N n2``) and are the only processes ``stop`` ends (by the pids they wrote). Clients find the
cluster through ``SLURM_CONF``. Starting takes about 0.3 s without accounting and 2.5 s with it
on an idle machine (4.5 to 7.5 s on a busy one; the SQL data directory and slurmdbd's tables
are made afresh for each cluster), stopping 4 to 5 s.

Workers rendezvous at the first node's *name*, so n1 and n2 must resolve: ``start`` appends
``127.0.0.1 n1 n2`` to /etc/hosts, marked with this cluster's directory, and ``stop`` removes
exactly that line again. Each cluster adds its own line even when the names already resolve:
two clusters at once (a test run beside a hand-started one) must not take the names away from
each other.

Accounting (Note [private accounting]): where Debian's ``slurmdbd`` and ``mariadb-server`` are
installed (``scripts/setup.sh --test``), the cluster also runs its own mariadbd (data directory,
socket in the cluster's directory, a free port) and its own slurmdbd, so ``sacct`` shows every
job and step a moment after it ends; ``cluster.accounting`` is None then, else the reason there is none (the
cluster starts without it and the accounting tests skip with that reason). Finished jobs also
go to a jobcomp text file either way, which the tests read for a job's final state.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 4
HOSTS_LINE = "127.0.0.1 n1 n2  # zerorun slurm test cluster {dir}"
DAEMONS = ("slurmctld", "slurmd", "munged")
# stop() ends the daemons in this order, those of one wave together: each takes about 2 s to end
# on SIGTERM, one by one the six took 12 s. slurmctld's last records still reach slurmdbd, and
# slurmdbd's reach its SQL server.
STOP_WAVES = {"slurmd": 1, "slurmctld": 1, "slurmdbd": 0, "mariadbd": 0, "munged": 0}
ACCOUNTING_PROGRAMS = ("mariadbd", "mariadb-install-db", "slurmdbd", "sacctmgr", "sacct")


def slurm_available() -> str | None:
    """None when a private cluster can be started here, else the reason why not."""
    missing = [name for name in ("slurmctld", "slurmd", "munged", "srun", "sbatch", "salloc") if not _installed(name)]
    if missing:
        return "Slurm is not installed (" + ", ".join(missing) + " missing; scripts/setup.sh --test installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "the private Slurm cluster runs its daemons as root"
    return None


def _installed(name: str) -> bool:
    return bool(shutil.which(name)) or Path("/usr/sbin", name).exists()


def accounting_available() -> str | None:
    """None when the private cluster can run its own slurmdbd here, else the reason why not."""
    missing = [name for name in ACCOUNTING_PROGRAMS if not _installed(name)]
    if missing:
        return ("no Slurm accounting (" + ", ".join(missing) + " missing; scripts/setup.sh --test installs "
                "slurmdbd and mariadb-server)")
    return None


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _resolves(name: str) -> bool:
    try:
        return socket.gethostbyname(name) == "127.0.0.1"
    except OSError:
        return False


class SlurmCluster:
    def __init__(self, workdir: Path, grace_time: int | None = None):
        """``grace_time`` set: a preempting cluster (Note [preempting cluster]) whose low
        partition's jobs get that many seconds between SIGTERM and the kill."""
        self.dir = Path(workdir).resolve()
        self.grace_time = grace_time
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge.socket"
        self.jobcomp = self.dir / "jobcomp.txt"
        self.host = socket.gethostname()
        self._hosts_line = HOSTS_LINE.format(dir=self.dir)
        self._added_hosts_line = False
        self._pid_files: list[tuple[int, Path]] = []  # (stop wave, pid file) of each daemon started
        # None: this cluster keeps accounting (slurmdbd); else why it does not.
        self.accounting: str | None = accounting_available()
        self._sql: subprocess.Popen[bytes] | None = None
        self._sql_port = 0

    @property
    def env(self) -> dict[str, str]:
        """The environment a client (sbatch, srun, squeue) needs to reach this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_config(self) -> None:
        ctld, n1, n2, dbd, sql = _free_ports(5)
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for name, port in zip(NODES, (n1, n2), strict=True))
        d = self.dir
        self.conf.write_text(f"""ClusterName=zerorun-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
{self._accounting_storage(dbd, sql)}JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=1
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=30
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
{self._preemption()}{nodes}
{self._partitions()}
""")
        # Debian's slurmd looks for cgroup.conf beside slurm.conf even with no cgroup plugin.
        (d / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")

    # Note [private accounting]: slurmdbd keeps its records in a SQL server, here a mariadbd
    # private to this cluster: its data directory, socket, pid and log file lie in the cluster's
    # directory and it listens on 127.0.0.1 on a free port, so it never meets a system service
    # or another cluster's server. Its only account is slurmdbd's, with a password made for this
    # cluster (in sql-init.sql, which mariadbd runs at its start, and slurmdbd.conf, both mode
    # 600, as slurmdbd demands for its file); root logs in through the socket only.
    # Small InnoDB files and no binary log keep the start short (about 0.5 s to create the data
    # directory) and the directory about 20 MB. slurmctld then sends every job and step to
    # slurmdbd (AccountingStorageType=accounting_storage/slurmdbd), where sacct reads them.
    SQL_OPTIONS = ("--innodb-log-file-size=4M", "--innodb-buffer-pool-size=16M")

    def _accounting_storage(self, dbd_port: int, sql_port: int) -> str:
        if self.accounting is not None:
            return "AccountingStorageType=accounting_storage/none\n"
        d = self.dir
        self._sql_port = sql_port
        password = os.urandom(12).hex()
        init = d / "sql-init.sql"
        init.touch(mode=0o600)  # before the password is in it
        init.write_text(f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';\n"
                        "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';\n")
        dbd_conf = d / "slurmdbd.conf"  # found beside slurm.conf (SLURM_CONF)
        dbd_conf.touch(mode=0o600)
        dbd_conf.write_text(f"""AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost={self.host}
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
PidFile={d}/slurmdbd.pid
LogFile={d}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={sql_port}
StorageUser=slurm
StoragePass={password}
StorageLoc=slurm_acct_db
""")
        return (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                f"AccountingStoragePort={dbd_port}\n"
                # Clients reach slurmdbd with this munge socket (the name is Slurm's, not a password).
                f"AccountingStoragePass={self.munge_socket}\n")

    def _start_accounting(self, timeout_s: float = 60.0) -> None:
        """mariadbd, slurmdbd, and this cluster's record in it (Note [private accounting])."""
        d = self.dir
        data = d / "sql-data"
        done = subprocess.run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={data}",
                               "--auth-root-authentication-method=socket", "--skip-test-db", *self.SQL_OPTIONS],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {done.stdout.decode(errors='replace')[-800:]}")
        pid_file = d / "mariadbd.pid"
        self._pid_files.append((STOP_WAVES["mariadbd"], pid_file))
        self._sql = subprocess.Popen(
            ["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}", f"--socket={d / 'mariadbd.sock'}",
             f"--port={self._sql_port}", "--bind-address=127.0.0.1", "--skip-name-resolve", "--skip-log-bin",
             f"--pid-file={pid_file}", f"--log-error={d / 'mariadbd.log'}", f"--init-file={d / 'sql-init.sql'}",
             "--innodb-flush-log-at-trx-commit=0", *self.SQL_OPTIONS],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not (pid_file.exists() and _listening(self._sql_port)):
            if self._sql.poll() is not None or time.monotonic() > deadline:
                log = (d / "mariadbd.log").read_text(errors="replace") if (d / "mariadbd.log").exists() else ""
                raise RuntimeError(f"mariadbd did not start: {log[-800:]}")
            time.sleep(0.05)
        self._start(["slurmdbd"], d / "slurmdbd.pid", "slurmdbd")
        # slurmdbd answers once it has created its tables: until then sacctmgr cannot connect.
        while True:
            added = self.run(["sacctmgr", "-i", "add", "cluster", "zerorun-test"], timeout=timeout_s)
            if added.returncode == 0 or "already exists" in added.stdout + added.stderr:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sacctmgr add cluster failed: {(added.stdout + added.stderr)[-800:]}")
            time.sleep(0.2)

    # Note [preempting cluster]: as HPC sites set it up. Jobs of the high partition (higher
    # PriorityTier) preempt running jobs of the low one, which are requeued (PreemptMode=REQUEUE,
    # JobRequeue=1); Slurm sends the low job SIGTERM (and SIGCONT) and kills it after its
    # partition's GraceTime. Without grace_time: one partition, "debug", and no preemption.
    def _preemption(self) -> str:
        if self.grace_time is None:
            return ""
        return "PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE\nJobRequeue=1\n"

    def _partitions(self) -> str:
        nodes = ",".join(NODES)
        if self.grace_time is None:
            return f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP"
        return (f"PartitionName=low Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
                f"PreemptMode=REQUEUE GraceTime={self.grace_time}\n"
                f"PartitionName=high Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF")

    def _start(self, argv: list[str], pid_file: Path, what: str, timeout_s: float = 30.0) -> None:
        self._pid_files.append((STOP_WAVES[argv[0]], pid_file))
        done = subprocess.run(argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{what} did not start: {done.stdout.decode(errors='replace')[-800:]}")
        deadline = time.monotonic() + timeout_s
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid_file.exists():
            raise RuntimeError(f"{what} wrote no pid file {pid_file}")

    def start(self) -> SlurmCluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool-n1", "spool-n2"):
            (self.dir / sub).mkdir(exist_ok=True)
        with open("/etc/hosts", "a") as hosts:
            hosts.write(self._hosts_line + "\n")
        self._added_hosts_line = True
        if not all(_resolves(name) for name in NODES):
            self.stop()
            raise RuntimeError("n1 and n2 do not resolve to 127.0.0.1 even with the /etc/hosts line")
        self._write_config()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        try:
            self._start(["munged", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                         f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'munged.log'}",
                         f"--seed-file={self.dir / 'munged.seed'}"], self.dir / "munged.pid", "munged")
            if self.accounting is None:
                self._start_accounting()
            self._start(["slurmctld", "-f", str(self.conf), "-i"], self.dir / "slurmctld.pid", "slurmctld")
            for name in NODES:
                self._start(["slurmd", "-f", str(self.conf), "-N", name], self.dir / f"slurmd-{name}.pid",
                            f"slurmd -N {name}")
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until both nodes are idle (registered with slurmctld)."""
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = done.stdout.strip()
            if done.returncode == 0 and all(f"{name} idle" in states for name in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout_s:.0f} s: {states!r}; see {self.dir}/*.log")

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(argv, **kwargs)

    def _alive(self, pid: int) -> bool:
        if self._sql is not None and self._sql.pid == pid:
            return self._sql.poll() is None  # our child: reaped here, not left a zombie
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """End exactly the daemons this object started (by their pid files), wave by wave (STOP_WAVES)."""
        for wave in sorted({wave for wave, _ in self._pid_files}, reverse=True):
            pids = []
            for pid_file in (pid_file for of, pid_file in self._pid_files if of == wave):
                try:
                    pid = int(pid_file.read_text().strip())
                    os.kill(pid, signal.SIGTERM)
                except (OSError, ValueError):
                    continue
                pids.append(pid)
            deadline = time.monotonic() + 10.0
            while any(self._alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            for pid in pids:
                if self._alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        self._pid_files.clear()
        if self._sql is not None and self._sql.poll() is None:  # started, but wrote no pid file
            self._sql.kill()
            self._sql.wait()
        if self._added_hosts_line:
            lines = Path("/etc/hosts").read_text().splitlines(keepends=True)
            Path("/etc/hosts").write_text("".join(line for line in lines if line.rstrip("\n") != self._hosts_line))
            self._added_hosts_line = False


if __name__ == "__main__":
    reason = slurm_available()
    if reason:
        sys.exit(reason)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    cluster = SlurmCluster(Path(sys.argv[1])).start()
    # sigwait below takes them, not a handler. Blocked only now: the daemons would inherit the
    # mask (a slurmd started with SIGTERM blocked did not end on stop's SIGTERM).
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    print(f"export SLURM_CONF={cluster.conf}", flush=True)
    try:
        signal.sigwait(stop_signals)
    finally:
        cluster.stop()
