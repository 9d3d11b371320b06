"""A learner sharded with FSDP2 over `placement.learner_procs` processes, driven phase by phase from one Lab.

executor.py: `RankExecutor`, the Lab's executor on a driver (the notebook's process); ranks.py: the rank processes
and their pipes; worker.py: a rank's process, which runs a one-process Lab of its own over its shard; wire.py: the
messages between them; remote.py: the driver's vLLM engine as the ranks' generator; fsdp.py: sharding, the
generation gather (P3), the reference check (P5); recovery.py: a failed pass reset and agreed; state.py: checkpoints
and adapters gathered whole; world.py: checks before any process starts. Which rank a process is: runtime.py.
"""
