"""The Ray driver of a learner sharded with FSDP2 over `placement.learner_procs` processes, driven phase by phase
from one Lab. Nothing in the one-process path imports it; the Lab reaches `RankExecutor` by name (grpo_lab/executor.py).

executor.py: `RankExecutor`, the Lab's executor on a driver (the notebook's process); ranks.py: the ranks as Ray
actors, every call's reply and memory samples collected, a dead rank's restart; ray_cluster.py: the Ray they run on
and their placement group; worker.py: a rank's actor, which runs a one-process Lab of its own over its shard;
wire.py: one-line errors and memory deltas, shared by both sides; remote.py: the driver's vLLM engine as the ranks'
generator. The FSDP building blocks the ranks run are in dist/; which rank a process is, in runtime.py.
"""
