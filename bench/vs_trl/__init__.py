"""Speed and memory against TRL's GRPOTrainer, side by side."""
