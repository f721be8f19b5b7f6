"""Sharded, atomic training checkpoints: engine state, on-disk format, resharding, safetensors i/o, consolidation."""
