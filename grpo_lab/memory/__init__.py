"""The memory observatory: readers (host, each GPU), the phase-aware sampler, leak detection, reports and plots."""

from .leaks import LeakDetector
from .sampler import HostMemoryExceeded, MemorySampler
from .tables import format_compact, format_table, peak_rows

__all__ = ["MemorySampler", "HostMemoryExceeded", "LeakDetector", "format_table", "format_compact", "peak_rows"]
