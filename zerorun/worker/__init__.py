"""What a training process decides about itself, with no launcher imported: its device (device.py)."""
