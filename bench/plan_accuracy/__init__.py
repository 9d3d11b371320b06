"""Accuracy of the memory plan: planned against measured host memory, and the measurements behind its terms."""
