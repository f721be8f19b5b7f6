"""Pre-flight: before any worker starts, check every host and report all problems at once.

Each host answers one probe (``probe_facts``, run in-process here and through ssh or srun elsewhere):
is the working directory there, is the script (or module) there, which Python and torch.
``compare_facts`` is pure: it turns the answers into a list of problems, one line each.
"""

from __future__ import annotations

import inspect
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

from zerorun.errors import LaunchError
from zerorun.launch.commands import on_host
from zerorun.launch.plan import LaunchPlan, NodeSpec

PROBE_TIMEOUT_S = 30.0


def probe_facts(cwd, script, module):
    """Runs on each host (its source is shipped over ssh, so it imports only the stdlib)."""
    import importlib.metadata
    import importlib.util
    import os
    import platform
    import sys

    facts = {"python": platform.python_version(), "cwd_ok": os.path.isdir(cwd), "torch": None}
    try:
        facts["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    if script:
        facts["script_ok"] = os.path.isfile(os.path.join(cwd, script))
    sys.path.insert(0, cwd)
    try:
        facts["zerorun_ok"] = importlib.util.find_spec("zerorun") is not None
    except (ImportError, ValueError):
        facts["zerorun_ok"] = False
    if module:
        try:
            facts["script_ok"] = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            facts["script_ok"] = False
    return facts


PROBE_SOURCE = inspect.getsource(probe_facts) + (
    "\nimport json, sys\nprint(json.dumps(probe_facts(sys.argv[1], sys.argv[2] or None, sys.argv[3] or None)))\n"
)


def compare_facts(reference_host: str, facts: dict[str, dict | str], script_label: str) -> list[str]:
    """Problems, one line each. ``facts[host]`` is a probe answer or an error string."""
    problems = []
    reference = facts.get(reference_host)
    for host, answer in facts.items():
        if isinstance(answer, str):
            problems.append(f"{host}: {answer}")
            continue
        if not answer.get("cwd_ok", False):
            problems.append(f"{host}: working directory does not exist there")
        elif not answer.get("script_ok", True):
            problems.append(f"{host}: {script_label} not found")
        if not answer.get("zerorun_ok", True):
            problems.append(f"{host}: zerorun is not importable by that Python (pip install -e . there)")
        if answer.get("torch") is None:
            problems.append(f"{host}: torch is not installed for that Python")
        if isinstance(reference, dict) and host != reference_host:
            for key, label in (("python", "Python"), ("torch", "torch")):
                if answer.get(key) and reference.get(key) and answer[key] != reference[key]:
                    problems.append(
                        f"{host}: {label} {answer[key]} differs from {reference[key]} on {reference_host}"
                    )
    return problems


def probe_remote(node: NodeSpec, plan: LaunchPlan, ssh_port: int | None, ssh_options: list[str]) -> dict | str:
    target = plan.target
    argv = [plan.python, "-c", PROBE_SOURCE, plan.cwd, target.script or "", target.module or ""]
    # cd / so a missing working directory is reported by the probe rather than by the shell.
    command = on_host(node.reach, node.host, "/", argv, ssh_port=ssh_port, ssh_options=ssh_options)
    how = node.reach
    try:
        done = subprocess.run(command, capture_output=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"no answer over {how} within {PROBE_TIMEOUT_S:.0f} s"
    except OSError as err:
        return f"cannot run {how}: {err}"
    stderr = done.stderr.decode("utf-8", "replace").strip().splitlines()
    if done.returncode == 255 and how == "ssh":
        return "unreachable over ssh: " + (stderr[-1] if stderr else "ssh exit code 255")
    if done.returncode == 127:
        return f"{plan.python} does not exist there"
    try:
        return json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return "probe failed: " + (stderr[-1] if stderr else f"exit code {done.returncode}")


def preflight(plan: LaunchPlan, *, ssh_port: int | None = None, ssh_options: list[str] | None = None) -> None:
    """Raise LaunchError listing every problem on every host; return quietly if there is none."""
    target = plan.target
    script_label = f"script {target.script}" if target.script else f"module {target.module}"
    local_host = next((node.host for node in plan.nodes if node.local), "launcher")
    facts: dict[str, dict | str] = {}
    local_needed = any(node.local for node in plan.nodes)
    remote = plan.remote_nodes
    local_facts: dict | None = None
    if local_needed or remote:
        facts[local_host] = local_facts = probe_facts(plan.cwd, target.script, target.module)
    if remote:
        with ThreadPoolExecutor(max_workers=min(16, len(remote))) as pool:
            answers = pool.map(lambda node: probe_remote(node, plan, ssh_port, ssh_options or []), remote)
            facts.update({node.host: answer for node, answer in zip(remote, answers, strict=True)})
    elif local_facts is not None:
        # Single-host runs use this very interpreter: only the script needs checking, and a
        # missing torch is the script's business (it may not use torch at all).
        local_facts["torch"] = local_facts["torch"] or "n/a"
    problems = compare_facts(local_host, facts, script_label)
    if problems:
        if len(problems) == 1:
            raise LaunchError(problems[0].removeprefix(f"{local_host}: ") if not remote else problems[0])
        raise LaunchError(f"pre-flight found {len(problems)} problems: " + "; ".join(problems))

