"""What runs inside a training process and must not import the launcher (tests/unit/test_layering.py):
its device (device.py), save-on-signal (save_on_signal.py) and what Slurm's environment says
(slurm_env.py, which the launcher builds on).
"""
