"""A Plan as a Rich table, and as plain JSON for scripts (pure: no printing here).

Every size is decimal GB (1 GB = 10^9 bytes), the unit the ZeRO paper's tables use; the
table title says so.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from zerorun.planner.plan import Option, Plan
from zerorun.planner.quantities import GB, format_count, format_gb, table_unit


def render_plan(plan: Plan):
    """Rich renderable: the options table, then the verdict and the recommendation."""
    largest = max(max(o.estimate.gpu_total, o.estimate.host_per_node, o.estimate.nvme_per_node) for o in plan.options)
    unit, unit_name = table_unit(largest)
    table = Table(title=_title(plan, unit_name), title_justify="left", show_lines=False)
    for header in ("stage", "offload"):
        table.add_column(header)
    for header in ("params", "grads", "optimizer", "model state", "buffers", "activations",
                   "GPU total", "host/node", "NVMe/node"):
        table.add_column(header, justify="right")
    table.add_column("fits")
    requested = plan.requested
    recommended = plan.recommended
    for option in plan.options:
        est = option.estimate
        style = "bold" if option is requested else None
        table.add_row(
            str(est.stage),
            est.offload + (" *" if option is requested else ""),
            format_gb(est.params, unit),
            format_gb(est.grads, unit),
            format_gb(est.optimizer, unit),
            format_gb(est.model_state, unit),
            format_gb(est.buffers, unit),
            "n/a" if est.activations is None else format_gb(est.activations, unit),
            format_gb(est.gpu_total, unit),
            format_gb(est.host_per_node, unit),
            format_gb(est.nvme_per_node, unit),
            _fits_cell(option, recommended),
            style=style,
        )
    return Group(table, *_footer(plan, requested, recommended))


def _title(plan: Plan, unit_name: str) -> str:
    model, job, training = plan.model, plan.job, plan.training
    largest = f", largest layer {format_count(model.largest_layer_params)}" if model.largest_layer_params else ""
    if model.frozen_params:  # no gradient or optimizer state for these (docs/estimate.md)
        largest = f" ({format_count(model.frozen_params)} frozen){largest}"
    precision = "fp32" if training.precision == "fp32" else f"{training.precision} mixed precision"
    acts = ""
    if plan.activation_job is not None:
        a = plan.activation_job
        acts = f", micro-batch {a.micro_batch} x {a.seq_len} tokens" + (" (checkpointed)" if a.checkpointing else "")
    return (
        f"{model.name}: {format_count(model.num_params)} params{largest}; "
        f"{job.world_size} ranks ({job.gpus_per_node} GPUs x {job.nodes} nodes); {precision} + Adam{acts}\n"
        f"per-GPU memory in {unit_name} (decimal, 1 {unit_name} = 10^{9 if unit_name == 'GB' else 6} bytes); "
        "host and NVMe per node"
    )


def _fits_cell(option: Option, recommended: Option | None) -> Text:
    if option.fits is None:
        return Text("-")
    if option is recommended:
        return Text("yes (pick)", style="bold green")
    if option.fits:
        return Text("yes", style="green")
    reasons = []
    if option.fits_gpu is False:
        reasons.append("GPU")
    if option.fits_host is False:
        reasons.append("host")
    return Text("no: " + "+".join(reasons), style="red")


def _footer(plan: Plan, requested: Option | None, recommended: Option | None) -> list[Text]:
    lines = []
    if requested is not None:
        unit, unit_name = table_unit(requested.estimate.gpu_total)
        lines.append(Text(f"* requested: {requested.label}: {format_gb(requested.estimate.gpu_total, unit)} "
                          f"{unit_name} per GPU" + _verdict(requested)))
    if plan.limits.gpu_bytes is None and plan.limits.host_bytes is None:
        lines.append(Text("give --gpu-memory / --host-memory for a verdict and a recommendation"))
    elif recommended is None:
        lines.append(Text("nothing fits: add GPUs or nodes, shorten the micro-batch, or turn on activation checkpointing",
                          style="bold red"))
    else:
        lines.append(Text(f"recommended: {recommended.label} (the cheapest option that fits)", style="bold green"))
    lines.append(Text("model state = params + grads + optimizer (the ZeRO paper's split); buffers = the largest of "
                      "backward's buckets/gathers, the step's workspace and (stage 3 with a prefetch budget) the "
                      "turn into backward; formulas: docs/estimate.md", style="dim"))
    if plan.activation_job is not None and plan.model.shape is None:
        lines.append(Text("activations n/a: the architecture is unknown (use --preset, --hf-config or --measure)"))
    return lines


def _verdict(option: Option) -> str:
    if option.fits is None:
        return ""
    return " - fits" if option.fits else " - does NOT fit"


def plan_to_json(plan: Plan) -> dict:
    """Plain data for ``--json``: bytes as integers, plus the same figures in decimal GB."""
    def row(option: Option) -> dict:
        est = option.estimate
        figures = {
            "params": est.params, "grads": est.grads, "optimizer": est.optimizer,
            "model_state": est.model_state, "buffers": est.buffers,
            "comm_buffers": est.comm_buffers, "backward_workspace": est.backward_workspace,
            "unreduced_gradients": est.unreduced_gradients, "turn_buffers": est.turn_buffers,
            "workspace": est.workspace,
            "activations": est.activations, "gpu_total": est.gpu_total,
            "host_per_node": est.host_per_node, "nvme_per_node": est.nvme_per_node,
            # already in host_per_node: Note [pinned arena] in zero/offload/pinned.py
            "pinned_slack_per_node": est.pinned_slack * est.ranks_per_host,
        }
        return {
            "stage": est.stage,
            "offload": est.offload,
            "bytes_per_gpu": {k: (None if v is None else int(round(v))) for k, v in figures.items()},
            "gb_per_gpu": {k: (None if v is None else round(v / GB, 4)) for k, v in figures.items()},
            "fits": option.fits,
            "fits_gpu": option.fits_gpu,
            "fits_host": option.fits_host,
        }

    recommended = plan.recommended
    requested = plan.requested
    return {
        "unit": "bytes; gb_per_gpu in decimal GB (1e9 bytes); host/nvme figures are per node",
        "model": {
            "name": plan.model.name,
            "num_params": plan.model.num_params,
            "largest_layer_params": plan.model.largest_layer_params,
            "frozen_params": plan.model.frozen_params,
        },
        "job": {"gpus_per_node": plan.job.gpus_per_node, "nodes": plan.job.nodes,
                "world_size": plan.job.world_size},
        "precision": plan.training.precision,
        "limits": {"gpu_bytes": plan.limits.gpu_bytes, "host_bytes": plan.limits.host_bytes},
        "options": [row(o) for o in plan.options],
        "requested": None if requested is None else {"stage": requested.estimate.stage,
                                                     "offload": requested.estimate.offload},
        "recommended": None if recommended is None else {"stage": recommended.estimate.stage,
                                                         "offload": recommended.estimate.offload},
    }


def render_traffic(rows, rate_bps: float, ranks_per_host: int, compute_s: float | None = None):
    """``zerorun estimate --link``: bytes per step per rank and the link time (planner/traffic.py)."""
    table = Table(title=f"Bytes each rank sends per step (MB = 10^6 bytes); link {rate_bps / 1e6:g} Mbit/s, "
                        f"{ranks_per_host} rank(s) per host", title_justify="left")
    table.add_column("stage")
    for header in ("to other hosts MB", "within host MB", "link s"):
        table.add_column(header, justify="right")
    if compute_s is not None:
        table.add_column(f"max(link, {compute_s:g} s compute)", justify="right")
    for row in rows:
        link_s = row.link_seconds(rate_bps, ranks_per_host)
        cells = [row.label, f"{row.link_bytes / 1e6:.1f}", f"{row.local_bytes / 1e6:.1f}", f"{link_s:.2f}"]
        if compute_s is not None:
            cells.append(f"{max(link_s, compute_s):.2f}")
        table.add_row(*cells)
    return table


def traffic_to_json(rows, rate_bps: float, ranks_per_host: int, compute_s: float | None = None) -> dict:
    return {"rate_bps": rate_bps, "ranks_per_host": ranks_per_host, "compute_s": compute_s,
            "rows": [{"label": r.label, "stage": r.stage, "link_bytes": r.link_bytes, "local_bytes": r.local_bytes,
                      "link_s": r.link_seconds(rate_bps, ranks_per_host)} for r in rows]}
