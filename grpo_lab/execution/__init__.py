"""Where a phase runs. The Lab keeps the config, the step lifecycle and the views; an executor does each phase's work:
contract.py (the Executor protocol, its `Sharding` capability, and which executor a config gets), local.py (this
process's models), sharded/ (a learner sharded with FSDP2 over Ray ranks: its state gathered whole, its checks before
start, and its Ray driver). This process's device, rank, RNG and collectives: grpo_lab/runtime.py, the bottom floor."""
