"""A learner sharded with FSDP2 over `placement.learner_procs` processes, driven phase by phase from one Lab.

executor.py: `RankExecutor`, the Lab's executor on a driver (the notebook's process); ranks.py: the ranks as Ray
actors, every call's reply and memory samples collected, a dead rank's restart; cluster.py: the Ray they run on and
their placement group; worker.py: a rank's actor, which runs a one-process Lab of its own over its shard; wire.py:
one-line errors and memory deltas, shared by both sides; remote.py: the driver's vLLM engine as the ranks' generator;
fsdp.py: sharding, the generation gather (P3), the reference check (P5); recovery.py: a failed pass reset and
agreed; state.py: checkpoints and adapters gathered whole; world.py: checks before any process starts. Which rank
a process is: runtime.py.
"""
