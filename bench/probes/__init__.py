"""Research probes: one question each (a layout, a library, a knob, a design choice), answered by measuring."""
