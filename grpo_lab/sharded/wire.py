"""The pipe between a sharded learner's driver and its ranks: pickled messages, one-line errors, and the memory
samples a rank took since its last message. Shared by both sides (ranks.py, worker.py), so neither imports the other.
"""
from __future__ import annotations

import pickle
import traceback


def send(conn, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))   # why plain pickle: tensors by value


def receive(conn):
    return pickle.loads(conn.recv_bytes())


def one_line(err: BaseException) -> str:
    from ..errors import LabError

    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, LabError):
        return text
    return f"{type(err).__name__}: {text}" if text else "".join(traceback.format_exception_only(type(err), err)).strip()


def memory_since(sampler, sent: dict) -> dict:
    """The samples and per-phase rows taken since the last reply (and advance `sent`)."""
    if sampler is None:
        return {}
    samples = sampler.samples_since(sent["samples"])
    rows = [dict(r) for r in sampler.phase_rows[sent["rows"]:]]
    sent["samples"], sent["rows"] = sampler.total, len(sampler.phase_rows)
    return {"t0": sampler.t0, "samples": samples, "rows": rows}
