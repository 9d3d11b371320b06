"""The config's building blocks: a field with its help text and when an edit takes effect (`knob`, WHEN), the
section base every edit of which goes through the root's one update path, device names, and `--set` overrides."""
from __future__ import annotations

import re
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from .errors import ConfigError

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


def knob(when: str, default: Any = ..., **kwargs) -> Any:
    """A config field with its help text and when a change takes effect (one of WHEN)."""
    assert when in WHEN, when
    return Field(default, json_schema_extra={"when": when}, **kwargs)


class Section(BaseModel):
    # why allow_inf_nan=False: an .inf or .nan in any float (lists included) is refused, never trained with;
    # str_min_length=1: an empty string is never a value (null is, where a field allows it)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, str_min_length=1)
    _root: Optional[Any] = PrivateAttr(None)   # the LabConfig this section belongs to (set by it)
    _name: str = PrivateAttr("")

    def __eq__(self, other: Any) -> bool:   # by value; the private links to the root would recurse
        return type(self) is type(other) and self.model_dump() == other.model_dump()

    __hash__ = None

    def __setattr__(self, name: str, value: Any) -> None:
        # why: every edit goes through the root's update (whole-config checks, a loaded Lab's guard), never one field alone
        if name in type(self).model_fields and self._root is not None:
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
                raise ConfigError(f"--set {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node[parts[-1]] = value
    return data
