"""Where a unit's master, optimizer state and (stage 3) parameter chunk live: device, host memory or files."""
