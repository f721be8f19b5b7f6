"""``zerorun --accelerate-config FILE``: an ``accelerate config`` file's DeepSpeed job, on zerorun's launcher.

    zerorun --accelerate-config accelerate.yaml train.py --lr 3e-4
    pytest tests/unit/test_accelerate_config.py tests/e2e/test_accelerate_launch.py

``accelerate launch`` turns the file (``distributed_type: DEEPSPEED`` and its ``deepspeed_config``
section) into a process count and ``ACCELERATE_*`` variables, and Accelerate inside the script
builds its ``DeepSpeedPlugin`` from those variables. ``from_accelerate_config`` computes the same
things (pure; a unit test compares its variables with Accelerate's own launcher's), so the job runs
under zerorun's launcher, with the dashboard, ``--as-deepspeed`` workers and the rest of a zerorun
job. Options given on zerorun's command line win over the file (``--nproc``, ``--gpus``, ports).

Every key of the file is accounted for, as in the DeepSpeed config (zerorun/config/deepspeed.py):
carried into the job, noted as having no effect, or an error (a key Accelerate does not know, a
value zerorun cannot honour), each error one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerorun.config.problems import Problems, unknown_key_message
from zerorun.errors import ConfigError

# Keys of the file's top level that say nothing zerorun's launcher acts on, with the values
# `accelerate config` writes when the feature is not asked for: those pass without a word, any
# other value gets a note.
NO_EFFECT: dict[str, tuple[Any, ...]] = {
    "compute_environment": ("LOCAL_MACHINE",),
    "main_training_function": ("main",),
    "downcast_bf16": ("no", False),
    "rdzv_backend": ("static",),
    "same_network": (True,),
    **{key: () for key in ("tpu_env", "tpu_use_cluster", "tpu_use_sudo", "tpu_name", "tpu_zone", "commands",
                           "command_file", "dynamo_config", "fsdp_config", "megatron_lm_config", "ipex_config",
                           "mpirun_config", "fp8_config", "parallelism_config")},
}
TOP_LEVEL = {"distributed_type", "num_processes", "num_machines", "machine_rank", "main_process_ip",
             "main_process_port", "use_cpu", "gpu_ids", "mixed_precision", "debug", "enable_cpu_affinity",
             "deepspeed_config", *NO_EFFECT}

# deepspeed_config keys -> the variable accelerate launch sets for each (utils/launch.py,
# prepare_deepspeed_cmd_env), its value lower-cased where Accelerate lower-cases it.
DEEPSPEED_VARIABLES = {
    "zero_stage": ("ACCELERATE_DEEPSPEED_ZERO_STAGE", False),
    "gradient_accumulation_steps": ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", False),
    "gradient_clipping": ("ACCELERATE_GRADIENT_CLIPPING", True),
    "offload_optimizer_device": ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", True),
    "offload_param_device": ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", True),
    "zero3_init_flag": ("ACCELERATE_DEEPSPEED_ZERO3_INIT", True),
    "zero3_save_16bit_model": ("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", True),
    "deepspeed_config_file": ("ACCELERATE_DEEPSPEED_CONFIG_FILE", False),
    "deepspeed_moe_layer_cls_names": ("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", False),
}
# deepspeed_config keys for the multi-machine launch (hostfile and filters) or with no effect here.
DEEPSPEED_LAUNCH_KEYS = {"deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter",
                         "deepspeed_multinode_launcher"}
MIXED_PRECISION = ("no", "fp16", "bf16")


@dataclass
class AccelerateLaunch:
    """What the file asks of the launcher: processes per host, hosts, and the workers' variables."""

    processes_per_host: int = 1
    num_machines: int = 1
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def read_accelerate_config(path: str | Path) -> AccelerateLaunch:
    """The file -> AccelerateLaunch; every failure is a one-line ConfigError naming the key."""
    from zerorun.config import sources

    data = sources.read_file(path)
    if isinstance(data, sources.EmptyConfig) or not isinstance(data, dict):
        raise ConfigError(f"accelerate config {str(path)!r} holds no mapping of keys",
                          hint="write it with `accelerate config`, or see docs/integrations.md")
    return from_accelerate_config(data, repr(str(path)))


def from_accelerate_config(data: dict, label: str = "(dict)") -> AccelerateLaunch:
    """An ``accelerate config`` mapping -> AccelerateLaunch (pure); raises ConfigError listing every problem."""
    problems = Problems()
    out = AccelerateLaunch()
    for key in data:
        if key not in TOP_LEVEL:
            problems.add(str(key), unknown_key_message(key, TOP_LEVEL, "Accelerate config key"))
    kind = data.get("distributed_type")
    if kind != "DEEPSPEED":
        problems.add("distributed_type", "zerorun --accelerate-config runs DeepSpeed jobs (distributed_type: "
                     "DEEPSPEED, what `accelerate config` writes when asked for DeepSpeed); for another kind use "
                     "accelerate launch, or zerorun --nproc N / --gpus N SCRIPT", kind)
    if data.get("use_cpu"):
        problems.add("use_cpu", "accelerate launch runs DeepSpeed only without --cpu (use_cpu: false); zerorun "
                     "starts CPU workers by itself on a machine without GPUs", True)
    _counts(data, out, problems)
    _precision(data, out, problems)
    section = data.get("deepspeed_config") or {}
    if not isinstance(section, dict):
        problems.add("deepspeed_config", "must be a mapping of keys to values", section)
        section = {}
    _deepspeed_section(section, out, problems)
    fields = [str(key) for key in section] + (["mixed_precision"] if "mixed_precision" in data else [])
    out.env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(fields).lower()
    out.env["ACCELERATE_USE_DEEPSPEED"] = "true"
    if data.get("debug"):
        out.env["ACCELERATE_DEBUG_MODE"] = "true"
    if data.get("enable_cpu_affinity"):
        out.env["ACCELERATE_CPU_AFFINITY"] = "1"
    gpu_ids = data.get("gpu_ids")
    if gpu_ids not in (None, "all"):
        out.env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    for key in sorted(set(data) & set(NO_EFFECT)):
        if data[key] not in (None, False, {}, [], *NO_EFFECT[key]):
            out.notes.append(f"accelerate config {key}: accepted; has no effect on zerorun's launcher")
    problems.raise_if_any(f"{label} (accelerate config)")
    return out


def _positive(data: dict, key: str, default: int, problems: Problems) -> int:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.add(key, "must be a whole number of at least 1", value)
        return default
    return value


def _counts(data: dict, out: AccelerateLaunch, problems: Problems) -> None:
    """Processes per host and hosts, as accelerate launch divides them (num_processes is the total)."""
    total = _positive(data, "num_processes", 1, problems)
    out.num_machines = _positive(data, "num_machines", 1, problems)
    if total % out.num_machines:
        problems.add("num_processes", f"is the total over all machines and must divide evenly among "
                     f"num_machines = {out.num_machines}", total)
    out.processes_per_host = max(1, total // out.num_machines)
    port = data.get("main_process_port")
    if port not in (None, 0):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            problems.add("main_process_port", "must be a port number (1-65535), or 0 for any free port", port)
        else:
            out.master_port = port
    if out.num_machines > 1:
        ip = data.get("main_process_ip")
        out.master_addr = str(ip) if ip else None
        if data.get("machine_rank", 0) not in (0, None):
            problems.add("machine_rank", "zerorun starts every machine from the first one over ssh (its "
                         "hostfile); run it there only, with machine_rank 0", data.get("machine_rank"))
    elif data.get("machine_rank", 0) not in (0, None):
        problems.add("machine_rank", "must be 0 with one machine", data.get("machine_rank"))


def _precision(data: dict, out: AccelerateLaunch, problems: Problems) -> None:
    value = data.get("mixed_precision", "no")
    text = "no" if value is None else str(value).lower()
    if text not in MIXED_PRECISION:
        hint = "fp8 is not supported by zerorun" if text == "fp8" else f"one of {', '.join(MIXED_PRECISION)}"
        problems.add("mixed_precision", f"must be {hint}", value)
        text = "no"
    out.env["ACCELERATE_MIXED_PRECISION"] = text


def _deepspeed_section(section: dict, out: AccelerateLaunch, problems: Problems) -> None:
    for key, value in section.items():
        path = f"deepspeed_config.{key}"
        if key in DEEPSPEED_VARIABLES:
            name, lower = DEEPSPEED_VARIABLES[key]
            if value is not None:
                out.env[name] = str(value).lower() if lower else str(value)
        elif key not in DEEPSPEED_LAUNCH_KEYS:
            problems.add(path, unknown_key_message(key, [*DEEPSPEED_VARIABLES, *DEEPSPEED_LAUNCH_KEYS],
                                                    "Accelerate DeepSpeed key"))
    if out.num_machines == 1:
        return
    launcher = section.get("deepspeed_multinode_launcher") or "pdsh"
    if launcher not in ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm", "nossh", "ssh"):
        problems.add("deepspeed_config.deepspeed_multinode_launcher", "must be one of DeepSpeed's launchers "
                     "(pdsh, openmpi, mvapich, mpich, impi, slurm, nossh)", launcher)
    elif launcher not in ("pdsh", "ssh"):
        out.notes.append(f"deepspeed_config.deepspeed_multinode_launcher {launcher!r}: zerorun reaches the "
                         "hostfile's machines over ssh (one agent per node) instead")
    hostfile = section.get("deepspeed_hostfile")
    if not hostfile:
        problems.add("deepspeed_config.deepspeed_hostfile", f"num_machines is {out.num_machines}: name the "
                     "hostfile listing them ('host slots=N' lines, DeepSpeed's format)")
    out.hostfile = str(hostfile) if hostfile else None
    include, exclude = section.get("deepspeed_inclusion_filter"), section.get("deepspeed_exclusion_filter")
    out.include = str(include) if include else None
    out.exclude = str(exclude) if exclude else None


def merge_into(options, launch: AccelerateLaunch, gpu_counter):
    """LaunchOptions with the file's values where the command line gave none (CLI > file): one
    worker per GPU for each process where GPUs are visible, CPU workers otherwise (as
    torchrun's --nproc_per_node under accelerate launch); the workers run --as-deepspeed."""
    import dataclasses

    nproc, gpus = options.nproc, options.gpus
    if nproc is None and gpus is None:
        if gpu_counter() > 0:
            gpus = launch.processes_per_host
        else:
            nproc = launch.processes_per_host
    return dataclasses.replace(
        options, nproc=nproc, gpus=gpus, as_deepspeed=True,
        hostfile=options.hostfile or launch.hostfile, include=options.include or launch.include,
        exclude=options.exclude or launch.exclude,
        num_nodes=options.num_nodes or (launch.num_machines if launch.num_machines > 1 else None),
        master_addr=options.master_addr or launch.master_addr,
        master_port=options.master_port or launch.master_port,
        extra_env={**launch.env, **options.extra_env})
