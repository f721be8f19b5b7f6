"""The sharding runtime: ZeRO stages 0-3 composed from small, single-concern modules."""
