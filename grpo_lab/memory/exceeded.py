"""The host guard's error: what crossed, where, and what the Lab put back."""

from __future__ import annotations

from typing import Optional

from ..errors import LabError


class HostMemoryExceeded(LabError):
    """Host RAM crossed memory.host_threshold: raised in a phase's work as it crosses (the live guard), as a phase
    ends, or before one starts. The Lab fills in `undone` (what it put back), as only it knows whether the step had
    applied an update."""

    def __init__(self, where: str, fix: str):
        super().__init__(where, fix)
        self.where, self.fix, self.undone = where, fix, None
        self.mark: Optional[str] = None  # the mark of its phase it crossed in (a tool loop's "turn 3"), if any

    def __str__(self) -> str:
        return f"{self.where}{', ' + self.undone if self.undone else ''}; {self.fix}"
