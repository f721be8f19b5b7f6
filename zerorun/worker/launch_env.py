"""Variables the launcher sets for every worker beyond torchrun's (pure names; imports nothing).

Read by the runtime (zero/offload/scratch.py, zero/comm/rendezvous.py) and written by
launch/prepare.py; a module of its own so the launcher names them without importing torch.
"""

# The launch's name for its scratch records (Note [one launch per run directory], launch/run_dir.py).
LAUNCH_ID_ENV = "ZERORUN_LAUNCH_ID"
# "signed": every rank of the launch holds the same secret (Note [authenticated rendezvous]).
RENDEZVOUS_MODE_ENV = "ZERORUN_RENDEZVOUS"
RUN_TOKEN_ENV = "ZERORUN_RUN_TOKEN"
# Ranks per host in rank order ("2,1"), so a worker knows which host each rank is on (Note [link
# classes] in zero/comm/link_split.py).
HOST_SLOTS_ENV = "ZERORUN_HOST_SLOTS"
