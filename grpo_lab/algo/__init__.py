"""The GRPO algorithm: the step and its phases (grpo.py), their order (phases.py, lifecycle.py), the containers
passed between them, the losses, importance sampling, the log-prob head and pass, rewards and prompts."""
