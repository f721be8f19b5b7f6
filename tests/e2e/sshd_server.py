"""A throwaway OpenSSH server on loopback for the multi-node tests (used by test_multinode*.py beside it).

It listens on 127.0.0.1 and 127.0.0.2 (Linux routes all of 127/8 to lo) on a free,
non-standard port, as the current user, with a host key and a client key made in a tmp
directory, so the tests need no system configuration and leave nothing behind.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
LOOPBACK_HOSTS = ("127.0.0.1", "127.0.0.2")


def sshd_available() -> str | None:
    """None when a loopback sshd can be started here, else the reason why not."""
    if not os.path.exists(SSHD):
        return "sshd is not installed (scripts/setup.sh --test installs openssh-server)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "the OpenSSH client (ssh, ssh-keygen) is not installed"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackSshd:
    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.port = _free_port()
        self.client_key = self.dir / "client_key"
        self.proc: subprocess.Popen | None = None

    @property
    def ssh_options(self) -> list[str]:
        """What the launcher passes to ssh (via --ssh-opt / ZERORUN_SSH_OPTS)."""
        return [
            "-i", str(self.client_key),
            "-o", "UserKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=no",
            "-o", "LogLevel=ERROR",
            "-o", "IdentitiesOnly=yes",
        ]

    def start(self) -> LoopbackSshd:
        self.dir.mkdir(parents=True, exist_ok=True)
        host_key = self.dir / "host_key"
        for key in (host_key, self.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        authorized = self.dir / "authorized_keys"
        authorized.write_text((self.dir / "client_key.pub").read_text())
        authorized.chmod(0o600)
        config = self.dir / "sshd_config"
        listen = "\n".join(f"ListenAddress {host}:{self.port}" for host in LOOPBACK_HOSTS)
        config.write_text(
            f"""{listen}
HostKey {host_key}
PidFile {self.dir / 'sshd.pid'}
AuthorizedKeysFile {authorized}
PermitRootLogin yes
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AllowUsers {getpass.getuser()}
LogLevel ERROR
"""
        )
        if os.geteuid() == 0:
            # sshd refuses to start as root without its privilege-separation directory.
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "sshd.log", "wb"),
            start_new_session=True,
        )
        self._wait_until_ready()
        return self

    def _wait_until_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.dir / 'sshd.log').read_text()}")
            probe = subprocess.run(
                ["ssh", "-p", str(self.port), *self.ssh_options, "-o", "BatchMode=yes", LOOPBACK_HOSTS[1], "true"],
                capture_output=True,
                stdin=subprocess.DEVNULL,
            )
            if probe.returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"sshd did not accept a login within {timeout_s} s: {probe.stderr.decode()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # Its own session: the group also holds the per-connection sshd children.
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
