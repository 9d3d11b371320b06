"""Where a phase runs. The Lab keeps the config, the step lifecycle and the views; an executor does each phase's work:
contract.py (the Executor protocol, and which one a config gets), local.py (this process's models), runtime.py (this
process's device, rank, RNG and collectives), sharded/ (a learner sharded with FSDP2 over Ray ranks: its FSDP building
blocks, its checks before start, and its Ray driver)."""
