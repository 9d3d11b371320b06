"""A model's 4-bit experts modules (those use_routed_experts marked with their counts), found once a model and found
again only after a module was registered on a module of a tree already searched (torch's global registration hook:
PEFT's wrapping, a module set on a parent), so a phase's count and release walk nothing on a dense model. Why on a
searched tree's modules alone: transformers' forward slices its layers' ModuleList, a new list registering them each
call. A module removed with `del` registers nothing: its experts stay in the found list, their count unchanged."""

from __future__ import annotations

import weakref

from torch.nn.modules.module import register_module_module_registration_hook

_changes = [0]  # registrations on a searched tree's modules: a found list older than the last is stale
_searched: weakref.WeakSet = weakref.WeakSet()  # every module of every tree searched
_found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (changes when found, its experts)


def _registered(parent, name, submodule) -> None:
    if parent in _searched:
        _changes[0] += 1


register_module_module_registration_hook(_registered)


def experts_modules(model) -> tuple:
    """`model`'s modules that count the experts they dequantize (models/routed_experts.py), in module order."""
    found = _found.get(model)
    if found is None or found[0] != _changes[0]:
        tree = list(model.modules())
        _searched.update(tree)
        found = (_changes[0], tuple(m for m in tree if hasattr(m, "experts_dequantized")))
        _found[model] = found
    return found[1]


def marked() -> None:
    """Modules were marked as experts (use_routed_experts): every found list is searched again at its next use."""
    _changes[0] += 1
