"""``zerorun consolidate CKPT OUT``: one full model from a sharded checkpoint.

    zerorun consolidate ckpts/ model.safetensors                 # the latest tag
    zerorun consolidate ckpts/global_step500 model.pt --format torch
    zerorun consolidate ckpts/ hf-out/ --like path/to/hf-model    # a from_pretrained directory
    zerorun consolidate lora-ckpts/ adapter/ --like path/to/base  # PEFT: an adapter directory

Streams tensor by tensor (zerorun/zero/checkpoint/consolidate.py Note [bounded consolidation]), so host
memory stays near the largest tensor, not the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("consolidate")
    def consolidate(
        checkpoint: Path = typer.Argument(..., metavar="CKPT", help="A checkpoint directory (its latest tag) or one tag's directory."),
        out: Path = typer.Argument(..., metavar="OUT", help="Output file, or directory with --hf-config/--like."),
        tag: Optional[str] = typer.Option(None, "--tag", help="Which tag of CKPT (default: latest)."),
        fmt: str = typer.Option("safetensors", "--format", help="safetensors (streamed) or torch (holds the whole model)."),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: the training dtype)."),
        hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="A Hugging Face config.json: write a model directory."),
        like: Optional[Path] = typer.Option(None, "--like", help="A Hugging Face model directory whose config and tokenizer files to copy; "
                                                                 "for a PEFT checkpoint, its base model (writes a PEFT adapter directory)."),
        strip_prefix: str = typer.Option("", "--strip-prefix", help="Drop this prefix from names (a wrapper module's, e.g. 'model.')."),
    ) -> None:
        """Write one full model (safetensors, torch, or a Hugging Face directory) from a sharded checkpoint."""
        from zerorun.zero.checkpoint.consolidate import consolidate as run

        done = run(checkpoint, out, tag=tag, fmt=fmt, dtype=dtype, hf_config=hf_config, like=like,
                   strip_prefix=strip_prefix)
        typer.echo(f"wrote {done['out']}: {done['tensors']} tensors, {done['bytes'] / 2**20:.1f} MiB "
                   f"(step {done['global_step']}, from {done['source']}); at most "
                   f"{done['peak_bytes'] / 2**20:.1f} MiB of tensors held at once")
        if done["tied"]:
            typer.echo(done["tied"])
