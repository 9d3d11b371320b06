"""A loaded model's weights held in this process's own memory, as the plan counts them from load on.

transformers loads a safetensors checkpoint on the CPU by memory-mapping it: a weight it keeps in the file's dtype
(the embedding and a tied LM head, norms and biases beside a 4-bit body; every weight without 4-bit) is a view of
the mapped file, and its pages are read in only when a forward first touches them. The plan counts the base weights
resident after load, so the first forward to read one whole (the LM head's matmul, in the first rollout's first
decoding step: 74 MiB at 152k x 128 in float32) would pay the load's memory inside that phase, past its plan.
`hold_in_memory` copies each such weight off the mapping once, at load, the way a GPU load or a dtype cast holds it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import torch

# why these: a checkpoint's tensors mapped by transformers (safetensors) or torch.load(mmap=True); not shared memory
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CHUNK = 16 * 2**20  # bytes copied before their mapped pages are let go
PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4  # (Linux's value; /proc/self/maps, which finds the mappings, is Linux's too)
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def checkpoint_mappings(maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int]]:
    """The address ranges [start, end) at which this process maps a checkpoint file (none where /proc is absent)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(CHECKPOINT_SUFFIXES):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def mapped_tensors(model: torch.nn.Module, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """`model`'s CPU parameters and buffers whose bytes lie in one of `ranges`, each once (a tied weight is one)."""
    out, seen = [], set()
    for tensor in (*model.parameters(), *model.buffers()):
        # (a subclass, FSDP2's DTensor, is a rank's shard, read off the file as it loaded: models/meta_load.py)
        if tensor.device.type != "cpu" or type(tensor.data) is not torch.Tensor or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        address = tensor.untyped_storage().data_ptr()
        if any(start <= address < end for start, end in ranges):
            out.append(tensor)
    return out


def hold_in_memory(model: torch.nn.Module) -> int:
    """Copy every CPU weight of `model` that is a view of a mapped checkpoint into memory of its own; the bytes
    copied. The tensor objects stay (a tied weight stays tied, PEFT's wrappers keep theirs); the mapping goes with
    its last view."""
    ranges = checkpoint_mappings()
    if not ranges:
        return 0
    copied, copies = 0, {}
    for tensor in mapped_tensors(model, ranges):
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if key not in copies:  # (two tensors over the same bytes, tied by storage, stay one)
            copies[key] = copy_off(tensor.data)  # why a copy: the mapped pages read once, into memory the plan counts
            copied += tensor.numel() * tensor.element_size()
        tensor.data = copies[key]
    return copied


def copy_off(source: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """A copy of `source` (a view of a mapped file) in memory of its own, `chunk` bytes at a time, each chunk's
    mapped pages let go once copied. Why: the mapping stays until the last weight's copy, so pages read for a copy
    would otherwise stay resident beside it: a load would pass its end by all the mapped weights' size."""
    if not source.is_contiguous():
        return source.clone()
    target = torch.empty_like(source)
    src, dst = source.reshape(-1).view(torch.uint8), target.reshape(-1).view(torch.uint8)
    start = source.data_ptr()
    released = -(-start // PAGE) * PAGE  # (the pages wholly inside the tensor: its neighbours' stay as they are)
    for offset in range(0, src.numel(), chunk):
        dst[offset : offset + chunk].copy_(src[offset : offset + chunk])
        done = (start + min(offset + chunk, src.numel())) // PAGE * PAGE
        if done > released:
            drop_pages(released, done - released)
            released = done
    return target


def drop_pages(address: int, length: int) -> None:
    """madvise(MADV_DONTNEED) over [address, address + length) of a file mapping: its pages leave this process's
    RSS (the page cache keeps them; a later read would map them again). Nothing where there is no libc madvise."""
    if LIBC is not None:
        LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_DONTNEED)
