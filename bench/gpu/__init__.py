"""GPU checks: every CUDA path and every GPU figure, each in one command."""
