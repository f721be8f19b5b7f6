"""The job-wide view's wire protocol and file (Note [one view under srun] in job_view.py), pure:
what node 0 writes for the other nodes to find it, and what it accepts from them.

    pytest tests/unit/test_job_view.py

Protocol, node N -> node 0, one JSON object per line:
    {"t": "hello", "token", "node"}   answered with "ok" (or the connection is closed)
    {"t": "tel", "line"}              one raw telemetry line of a worker (its launcher's token)
    {"t": "exit", "rank", "rc", "at", "tail"}   a worker ended; when its launcher saw it (wall
                                      clock) and, when it failed, its last output lines
                                      (Note [one cause under srun] in job_cause.py)
    {"t": "done"}                     the node's launcher has seen every worker end

A connection proves itself by its first line (``check_hello``: the token, a node other than 0);
every later line (at most MAX_FORWARD_LINE bytes, as node 0's listener reads it) is checked by
``merge_event`` (JSON of a known kind, naming a rank of the node that sent it) before node 0
takes it as its own event.
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path

VIEW_FILE = "job-view.json"
# One forwarded line at most: a telemetry line (64 KiB) with its JSON escapes, as channel.py.
MAX_FORWARD_LINE = 1 << 20
# The output lines a failed rank's exit carries to node 0 (each cut to channel.SHOWN_LINE_CHARS):
# enough for a traceback, and far below MAX_FORWARD_LINE.
FORWARDED_TAIL_LINES = 60


def view_file(run_dir: str | Path) -> Path:
    """Node 0's job-view file, seen from any node's run directory (``<step run dir>/nodeN``)."""
    return Path(run_dir).parent / "node0" / VIEW_FILE


def node_ranks(node_rank: int, per_node: int) -> range:
    """The ranks of a node of the step: every node runs ``per_node`` workers (job_hosts.step_hosts)."""
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rank_label(ranks: range) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def encode(event: dict) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


def _json_object(raw: bytes | str) -> dict | None:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def check_hello(raw: bytes, token: str, nodes: int) -> int | None:
    """The node rank a first line proves it is (the right token, a node other than 0), else None."""
    hello = _json_object(raw)
    if hello is None or hello.get("t") != "hello":
        return None
    sent, node = hello.get("token"), hello.get("node")
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), token.encode()):
        return None
    if not isinstance(node, int) or isinstance(node, bool) or not 1 <= node < nodes:
        return None
    return node


def _is_rank(value, ranks: range) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in ranks


def _exit_details(event: dict) -> tuple[float, tuple[str, ...]] | None:
    """An exit event's time and output tail (both optional: 0.0 and ()), None when malformed."""
    at, tail = event.get("at", 0.0), event.get("tail", [])
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not isinstance(tail, list):
        return None
    if len(tail) > FORWARDED_TAIL_LINES or not all(isinstance(line, str) for line in tail):
        return None
    return float(at), tuple(tail)


def merge_event(raw: bytes, ranks: range, token: str) -> tuple | None:
    """A line forwarded by a node whose workers are ``ranks``, as node 0's own event:
    ("tel", line stamped with node 0's collector token), ("exit", rank, rc, at, tail),
    ("done",), or None for anything else (not JSON, another node's rank, an unknown kind)."""
    event = _json_object(raw)
    if event is None:
        return None
    kind = event.get("t")
    if kind == "tel" and isinstance(event.get("line"), str):
        record = _json_object(event["line"])
        if record is None or not _is_rank(record.get("rank"), ranks):
            return None
        record["token"] = token  # the forwarding node's token is its collector's, not ours
        return ("tel", json.dumps(record, separators=(",", ":")).encode("utf-8", "surrogateescape"))
    if kind == "exit" and _is_rank(event.get("rank"), ranks):
        rc, details = event.get("rc"), _exit_details(event)
        if not isinstance(rc, int) or isinstance(rc, bool) or details is None:
            return None
        return ("exit", event["rank"], rc, *details)
    if kind == "done":
        return ("done",)
    return None


def write_view_file(path: Path, port: int, token: str) -> None:
    """Atomically, readable by this user only: the token is the listener's secret."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"port": port, "token": token}, f)
    os.replace(temporary, path)


def read_view_file(path: Path) -> tuple[int, str]:
    """(port, token); ValueError for a file that is not one node 0 wrote, OSError when absent."""
    data = _json_object(path.read_bytes()[:4096])
    port, token = (data or {}).get("port"), (data or {}).get("token")
    if not isinstance(port, int) or not 0 < port < 65536 or not isinstance(token, str):
        raise ValueError(f"{path} is not a job-view file")
    return port, token
