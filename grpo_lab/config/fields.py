"""The config's building blocks: a field with its help text and when an edit takes effect (`knob`, WHEN), the
section base every edit of which goes through the root's one update path, device names, and `--set` overrides."""

from __future__ import annotations

import re
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ..errors import ConfigError

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def normalize_device(value: Any) -> str:
    """'cuda' -> 'cuda:0', 1 -> 'cuda:1'; anything not cpu/cuda[:N] is rejected."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a device; use 'cpu', 'cuda:N' or a GPU index")
    if isinstance(value, int):
        return f"cuda:{value}"
    text = str(value).strip()
    if not _DEVICE.match(text):
        raise ValueError(f"{value!r} is not a device; use 'cpu', 'cuda:N' or a GPU index")
    return "cuda:0" if text == "cuda" else text


# When a field's new value takes effect in a loaded Lab (declared next to every field's help text):
WHEN = {
    "live": "read at the next phase that uses it",
    "rebuild": "a change rebuilds the part that depends on it, at once",
    "load": "fixed when the Lab loads; refused after load (make a new Lab)",
}


def knob(when: str, default: Any = ..., *, planned: bool = False, cuda_only: bool = False, **kwargs) -> Any:
    """A config field with its help text, when a change takes effect (one of WHEN), whether the memory plan reads
    it (`planned`: tests/test_planned_fields.py fails when a marked field moves no plan, or an unmarked one does), and
    whether it bears only on CUDA devices (`cuda_only`: the panel's editor marks it on a CPU Lab)."""
    assert when in WHEN, when
    extra = {"when": when, "planned": planned} | ({"cuda_only": True} if cuda_only else {})
    return Field(default, json_schema_extra=extra, **kwargs)


# TRL's spellings of fields grpo_lab names otherwise, accepted everywhere a field is named (YAML, --set, dicts,
# lab.configure, attribute assignment); the config keeps and shows grpo_lab's name
ALIASES = {
    f"grpo.vllm_importance_sampling_{k}": f"grpo.importance_sampling_{k}"
    for k in ("correction", "mode", "clip_max", "clip_min")
}


def canonical(path: str) -> str:
    """'section.field' under grpo_lab's name (a TRL alias resolved)."""
    return ALIASES.get(path, path)


def resolve_aliases(data: dict) -> dict:
    """A config dict with TRL's spellings renamed (a new dict); both spellings of one field is one line."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in data.items()}
    for alias, name in ALIASES.items():
        section, _, old = alias.partition(".")
        values = out.get(section)
        if isinstance(values, dict) and old in values:
            new = name.partition(".")[2]
            if new in values:
                raise ConfigError(f"{alias}: given with {name}, its grpo_lab name; give one of them")
            values[new] = values.pop(old)
    return out


class Section(BaseModel):
    # why allow_inf_nan=False: an .inf or .nan in any float (lists included) is refused, never trained with;
    # str_min_length=1: an empty string is never a value (null is, where a field allows it)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, str_min_length=1)
    _root: Optional[Any] = PrivateAttr(None)  # the LabConfig this section belongs to (set by it)
    _name: str = PrivateAttr("")

    def __eq__(self, other: Any) -> bool:  # by value; the private links to the root would recurse
        return type(self) is type(other) and self.model_dump() == other.model_dump()

    __hash__ = None

    def __setattr__(self, name: str, value: Any) -> None:
        # why: every edit goes through the root's update (whole-config checks, a loaded Lab's guard), never one
        # field alone
        path = canonical(f"{self._name}.{name}")
        if path != f"{self._name}.{name}" and self._root is not None:  # a TRL spelling
            self._root.update({path: value})
        elif name in type(self).model_fields and self._root is not None:
            self._root.update({f"{self._name}.{name}": value})
        else:
            super().__setattr__(name, value)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply 'a.b=c' overrides (values parsed as YAML) to a nested dict, returning a new dict."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. grpo.beta=0.04")
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node[parts[-1]] = value
    return data
