"""One job-wide view under ``srun --ntasks-per-node=1 zerorun``: node 0 shows every rank.

Note [one view under srun]: under srun every node runs a launcher of its own, each supervising
its own node's workers (slurm.step_role), and srun merges their outputs into one stream. Each
launcher alone would show the other nodes' ranks as ``?`` and a "job throughput" of one node.
So node 0's launcher listens on a TCP port and every other node's launcher forwards its
workers' telemetry lines and exit codes there, as JSON lines; node 0 feeds them to its
collector exactly as its own agent's events, so its dashboard, end summary, metrics.jsonl and
``zerorun report`` cover every rank of the job. The other launchers print their workers' lines
and one closing line pointing at node 0's summary: their status lines and summaries would
only repeat, beside node 0's, what node 0 already shows.

How they find each other without talking: node 0 listens on a free port (none to collide
with) and writes the port and a fresh token into ``<step run dir>/node0/job-view.json``
(mode 0600); the other nodes read that file, their run directories being its siblings on the
filesystem every node of a job sees (where the job's checkpoints go too), and connect to node
0 by its Slurm node name, as the workers' rendezvous does. The token is the secret the
listener needs (GUIDE 3a): a connection that does not present it in its first line within
HELLO_TIMEOUT_S is closed, every forwarded line is size-limited JSON, a forwarded record
must name a rank of the node that sent it, and the collector checks its schema again. A node
joins once (its forwarder never reconnects): a second hello naming a node that has joined is
refused and counted, and node 0's closing lines name the node, so another holder of the token
cannot forge a joined node's exits.

A forwarding failure never ends or holds up the training: the forwarder sends from a bounded
buffer on a thread of its own; when the file does not appear, node 0 cannot be reached or the
connection breaks, the node goes back to its own per-node view with one line saying why, and
node 0's summary names the nodes whose ranks it lacks. Threads are daemons and every socket is
closed in ``stop``; node 0 removes its file.

The wire protocol (node N -> node 0, one JSON object per line), the job-view file and the
checks node 0 makes of every line are pure functions in job_view_protocol.py.
"""

from __future__ import annotations

import collections
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from zerorun.launch.job_cause import RemoteExit, job_root_cause
from zerorun.launch.job_view_protocol import (
    FORWARDED_TAIL_LINES, MAX_FORWARD_LINE, check_hello, encode, merge_event, node_ranks, rank_label, read_view_file,
    view_file, write_view_file,
)
from zerorun.launch.supervisor import Failure
from zerorun.ui.live import JobView

HELLO_TIMEOUT_S = 10.0
# How long a node keeps trying to reach node 0 (node 0's pre-flight may take this long).
CONNECT_WINDOW_S = 120.0
# Bytes a node holds for node 0 while it connects (or while node 0 reads slowly); beyond, lines drop.
MAX_BUFFER_BYTES = 16 << 20
SEND_TIMEOUT_S = 30.0
# At the end, node 0 waits this long for a connected node's "done", a never-connected one's less.
DRAIN_CONNECTED_S = 10.0
DRAIN_UNCONNECTED_S = 3.0


# --- node 0: the listener ---------------------------------------------------------------


def listen_anywhere() -> socket.socket:
    """A listener on a free port of every address: the other nodes reach node 0 by its node
    name, which may resolve to IPv4 or IPv6 (IPv4 only where IPv6 is switched off)."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError:
            pass
    return socket.create_server(("", 0))


class ViewServer:
    """Node 0's listener: every other node's forwarded events into ``view`` (a JobView)."""

    def __init__(self, view: JobView, *, path: Path, nodes: tuple[str, ...], per_node: int):
        self.view = view
        self.path = path
        self.nodes = nodes
        self.per_node = per_node
        self.token = secrets.token_hex(16)
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._changed = threading.Condition()
        self.joined: set[int] = set()
        self.done: set[int] = set()
        self.lost: dict[int, str] = {}
        self.failed: list[RemoteExit] = []  # the other nodes' failed workers, as they came
        self.refused: dict[int, int] = {}  # node -> hellos refused because it had joined already
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Listen and write the file; OSError when either cannot be done (the caller degrades)."""
        listener = listen_anywhere()
        listener.settimeout(0.5)  # accept() wakes to see close(): closing alone does not wake it
        self._listener = listener
        try:
            write_view_file(self.path, listener.getsockname()[1], self.token)
        except OSError:
            listener.close()
            raise
        self._spawn(self._accept_loop)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="zerorun-job-view", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            # A bound on connections: the other nodes and a few that fail their hello.
            if sum(thread.is_alive() for thread in self._threads) > 2 * len(self.nodes) + 8:
                conn.close()
                continue
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        node = None
        with self._changed:
            self._conns.add(conn)
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            reader = conn.makefile("rb")
            claimed = check_hello(reader.readline(MAX_FORWARD_LINE), self.token, len(self.nodes))
            if claimed is None or self._closed.is_set():
                return
            with self._changed:  # checked and taken under one lock: two hellos cannot both join
                if claimed in self.joined:
                    # A node joins once (its forwarder never reconnects): a second hello for it
                    # is someone else holding the token, and could forge its exits.
                    self.refused[claimed] = self.refused.get(claimed, 0) + 1
                    return
                node = claimed
                self.joined.add(node)
                self.lost.pop(node, None)
                self._changed.notify_all()
            conn.sendall(b"ok\n")
            conn.settimeout(None)  # close() shuts the connection down to end this read
            self._read_events(node, reader)
        except OSError as err:
            if node is not None:
                with self._changed:
                    self.lost.setdefault(node, f"the connection broke ({err})")
        finally:
            conn.close()
            with self._changed:
                self._conns.discard(conn)
                if node is not None and node not in self.done:
                    self.lost.setdefault(node, "its launcher closed the connection before its workers ended")
                self._changed.notify_all()

    def _read_events(self, node: int, reader) -> None:
        ranks, host = node_ranks(node, self.per_node), self.nodes[node]
        while True:
            raw = reader.readline(MAX_FORWARD_LINE)
            if not raw:
                return
            if not raw.endswith(b"\n"):  # longer than any forwarded line: skip the rest of it
                while raw and not raw.endswith(b"\n"):
                    raw = reader.readline(MAX_FORWARD_LINE)
                self.view.collector.count_dropped("oversized")
                continue
            event = merge_event(raw, ranks, self.view.token)
            if event is None:
                self.view.collector.count_dropped("schema")
            elif event[0] == "tel":
                self.view.on_telemetry(host, event[1])
            elif event[0] == "exit":
                self.view.on_worker_exit(host, event[1], event[2])
                if event[2] != 0:
                    with self._changed:
                        self.failed.append(RemoteExit(node, host, *event[1:]))
            else:
                with self._changed:
                    self.done.add(node)
                    self._changed.notify_all()

    def wait_for_nodes(self, connected_s: float = DRAIN_CONNECTED_S,
                       unconnected_s: float = DRAIN_UNCONNECTED_S) -> None:
        """Until every other node has said "done" (its last records are in), within bounds."""
        start = time.monotonic()
        others = set(range(1, len(self.nodes)))
        with self._changed:
            while True:
                waiting = others - self.done - set(self.lost)
                if not waiting:
                    return
                limit = connected_s if waiting <= self.joined else unconnected_s
                left = start + limit - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(min(left, 0.5))

    def missing(self) -> dict[int, str]:
        """The nodes whose ranks this view lacks (some or all of), with why."""
        with self._changed:
            return {node: self.lost.get(node, "it did not connect" if node not in self.joined
                                        else "its last records did not arrive in time")
                    for node in range(1, len(self.nodes)) if node not in self.done}

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._changed:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=2.0)
        try:
            if read_view_file(self.path)[1] == self.token:  # a later run's file is not ours to remove
                self.path.unlink()
        except (OSError, ValueError):
            pass


# --- nodes 1..N-1: the forwarder -----------------------------------------------------------


class ViewForwarder:
    """Sends this node's events to node 0 from a bounded buffer, on a thread of its own.

    ``on_failure(reason)`` is called once, from that thread, when node 0 cannot be reached or
    the connection breaks; from then on events are dropped (the node shows its own view)."""

    def __init__(self, *, path: Path, host: str, node_rank: int, on_failure: Callable[[str], None],
                 connect_window_s: float | None = None):
        self.path = path
        self.host = host
        self.node_rank = node_rank
        self.on_failure = on_failure
        self.connect_window_s = CONNECT_WINDOW_S if connect_window_s is None else connect_window_s
        self.state = "connecting"  # -> "live" -> "done", or -> "failed"
        self.dropped = 0
        self.last_error = "node 0 was not reached"  # why the last try to connect failed
        self._buffer: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._cond = threading.Condition()
        self._finishing = False
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="zerorun-job-view", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def telemetry(self, raw_line: bytes) -> None:
        self._put({"t": "tel", "line": raw_line.decode("utf-8", "surrogateescape")})

    def worker_exited(self, rank: int, rc: int, tail: list[str] | None = None) -> None:
        self._put({"t": "exit", "rank": rank, "rc": rc, "at": time.time(), "tail": tail or []})

    def _put(self, event: dict) -> None:
        line = encode(event)
        with self._cond:
            if self.state == "failed" or self._finishing:
                return
            if self._buffered + len(line) > MAX_BUFFER_BYTES:
                self.dropped += 1
                return
            self._buffer.append(line)
            self._buffered += len(line)
            self._cond.notify_all()

    def finish(self, timeout_s: float = DRAIN_CONNECTED_S) -> bool:
        """Send "done" after everything buffered, close; True when node 0 got it all."""
        self._put({"t": "done"})
        with self._cond:
            self._finishing = True
            self._cond.notify_all()
        # Still connecting at the end (node 0 not yet up, or never): a short wait only.
        self._thread.join(timeout=timeout_s if self.state == "live" else min(timeout_s, DRAIN_UNCONNECTED_S))
        if self._thread.is_alive():
            connecting = self.state == "connecting"
            self._fail(self.last_error if connecting else "node 0 did not take this node's last records in time")
        sock = self._sock
        if sock is not None:
            sock.close()
        return self.state == "done" and not self.dropped

    def _fail(self, reason: str) -> None:
        with self._cond:
            if self.state in ("failed", "done"):
                return
            self.state = "failed"
            self._buffer.clear()
            self._cond.notify_all()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a send blocked on a node 0 that stopped reading
            except OSError:
                pass
        self.on_failure(reason)

    def _run(self) -> None:
        try:
            self._sock = self._connect()
        except (OSError, ValueError) as err:
            self._fail(str(err))
            return
        with self._cond:
            failed = self.state == "failed"
            if not failed:
                self.state = "live"
        if failed:
            self._sock.close()
            return
        self._send_all(self._sock)

    def _connect(self) -> socket.socket:
        """Read node 0's file and connect, again until it works or the window closes (a file
        of an earlier run of the step can be there before node 0 writes its own)."""
        deadline = time.monotonic() + self.connect_window_s
        while True:
            try:
                port, token = read_view_file(self.path)
            except FileNotFoundError:
                self.last_error = (f"{self.path} did not appear (node 0 not started, or the run directory is "
                                   "not on a filesystem every node sees)")
            except (OSError, ValueError) as err:
                self.last_error = f"cannot read {self.path}: {err}"
            else:
                try:
                    return self._hello(port, token)
                except OSError as err:
                    self.last_error = f"cannot reach node 0 at {self.host}:{port}: {err}"
            with self._cond:
                if self.state == "failed":
                    raise OSError(self.last_error)
            if time.monotonic() >= deadline:
                raise OSError(f"{self.last_error} (tried for {self.connect_window_s:g} s)")
            time.sleep(0.2)

    def _hello(self, port: int, token: str) -> socket.socket:
        sock = socket.create_connection((self.host, port), timeout=HELLO_TIMEOUT_S)
        try:
            sock.sendall(encode({"t": "hello", "token": token, "node": self.node_rank}))
            answer = sock.makefile("rb").readline(16)
            if answer != b"ok\n":
                raise OSError("node 0 refused the hello (a job-view file of an earlier run?)")
            sock.settimeout(SEND_TIMEOUT_S)
            return sock
        except BaseException:
            sock.close()
            raise

    def _send_all(self, sock: socket.socket) -> None:
        while True:
            with self._cond:
                while not self._buffer and self.state == "live" and not self._finishing:
                    self._cond.wait()
                if self.state != "live":
                    return
                if not self._buffer:  # finishing, and "done" was sent
                    self.state = "done"
                    return
                chunk = b"".join(self._buffer)
                self._buffer.clear()
                self._buffered = 0
            try:
                sock.sendall(chunk)
            except OSError as err:
                self._fail(f"the connection to node 0 broke ({err})")
                return
            if chunk.endswith(b'{"t":"done"}\n'):
                with self._cond:
                    if self.state == "live":
                        self.state = "done"
                return


# --- the two views ------------------------------------------------------------------------


class JobWideView(JobView):
    """Node 0's view: its own workers' events, and every other node's through a ViewServer."""

    def __init__(self, *, nodes: tuple[str, ...], per_node: int, **kwargs):
        super().__init__(**kwargs)
        self.server: ViewServer | None = ViewServer(self, path=view_file(self.run_dir), nodes=nodes,
                                                    per_node=per_node)

    def start(self) -> None:
        super().start()
        server = self.server
        if server is None:
            return
        try:
            server.start()
        except OSError as err:
            self.server = None
            self._note(f"no job-wide view (cannot listen or write {server.path}: {err}); this output "
                       "shows node 0's ranks only, every node's output its own")

    def stop(self, failed: bool, *, interrupted: bool = False) -> None:
        server = self.server
        if server is not None:
            if failed or interrupted:  # the other nodes are ending too, or Slurm is ending them all
                server.wait_for_nodes(DRAIN_UNCONNECTED_S, DRAIN_UNCONNECTED_S)
            else:
                server.wait_for_nodes()
            server.close()
            for node, why in sorted(server.missing().items()):
                ranks = rank_label(node_ranks(node, server.per_node))
                self._note(f"node {node} ({server.nodes[node]}): {why}, so its {ranks} may be missing "
                           "here; that node's own output and run directory have them")
            for node, count in sorted(server.refused.items()):
                self._note(f"node {node} ({server.nodes[node]}): refused {count} more connection(s) claiming "
                           "it after it had joined (a node joins once; its own events stand): something "
                           f"else holds the token in {server.path}")
            # A rank of another node that failed fails the job, whatever node 0's own ranks did.
            failed = failed or bool(server.failed) and not interrupted
        super().stop(failed, interrupted=interrupted)

    def job_root_cause(self, local: tuple[float, Failure] | None) -> Failure | None:
        """The job's root cause among every node's failures (Note [one cause under srun]), once
        ``stop`` has taken the other nodes' last events in; ``local``: this node's (when, what)."""
        failed = [] if self.server is None else list(self.server.failed)
        return job_root_cause(local, failed, self.run_dir.parent)

    def _note(self, text: str) -> None:
        self.on_output("launcher", -1, text)


class NodeView(JobView):
    """A node other than 0: its workers' lines, and their events forwarded to node 0's view."""

    writes_monitor = False  # node 0's view writes the job's series (Note [one writer])

    def __init__(self, *, nodes: tuple[str, ...], node_rank: int, per_node: int, **kwargs):
        super().__init__(**kwargs)
        self.node_rank = node_rank
        self.node0 = nodes[0]
        self.ranks = node_ranks(node_rank, per_node)
        self.forwarder = ViewForwarder(path=view_file(self.run_dir), host=nodes[0], node_rank=node_rank,
                                       on_failure=self._forwarding_failed)
        self._delivered = False
        # Each rank's last output lines: a failed rank's go to node 0 with its exit.
        self._tails: dict[int, collections.deque[str]] = {
            rank: collections.deque(maxlen=FORWARDED_TAIL_LINES) for rank in self.ranks}

    def start(self) -> None:
        super().start()
        self.forwarder.start()

    def on_telemetry(self, host: str, raw_line: bytes) -> None:
        super().on_telemetry(host, raw_line)
        self.forwarder.telemetry(raw_line)

    def on_output(self, host: str, rank: int, line: str) -> None:
        super().on_output(host, rank, line)
        tail = self._tails.get(rank)
        if tail is not None:
            tail.append(line)

    def on_worker_exit(self, host: str, rank: int, returncode: int) -> None:
        super().on_worker_exit(host, rank, returncode)
        tail = self._tails.get(rank, ()) if returncode != 0 else ()
        self.forwarder.worker_exited(rank, returncode, list(tail))

    def shows_status(self) -> bool:
        return self.forwarder.state == "failed"

    def stop(self, failed: bool, *, interrupted: bool = False) -> None:
        self._delivered = self.forwarder.finish(DRAIN_UNCONNECTED_S if failed or interrupted else DRAIN_CONNECTED_S)
        super().stop(failed, interrupted=interrupted)
        if self._delivered:
            # Printed whole, not by the console: one line however long the path, for grep.
            verb = "is" if len(self.ranks) == 1 else "are"
            self._print(f"zerorun: node {self.node_rank}: its {rank_label(self.ranks)} {verb} in the job-wide "
                        f"summary in node 0's output ({self.node0}); this node's records: {self.run_dir}/metrics.jsonl")

    def closing_words(self, snapshot, *, failed: bool, interrupted: bool):
        if self._delivered:
            return None
        return super().closing_words(snapshot, failed=failed, interrupted=interrupted)

    def _forwarding_failed(self, reason: str) -> None:
        self.on_output("launcher", -1, f"node {self.node_rank}: no job-wide view on node 0 ({reason}); this "
                       f"node shows its own {rank_label(self.ranks)}")
