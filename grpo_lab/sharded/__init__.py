"""A learner sharded with FSDP2 over `placement.learner_procs` processes, driven phase by phase from one Lab.

world.py: this process's rank and the few collectives a step needs (one process = world of one);
fsdp.py: sharding the learner and the reference, the generation gather (P3), the reference check (P5);
worker.py: a rank's process, which runs a Lab of its own; driver.py: `ShardedLab`, the notebook's handle.
"""
