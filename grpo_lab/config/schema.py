"""The one typed config behind the notebook, the CLI, the widget editor and papermill: `LabConfig`, the nine sections
of models_and_devices.py (model, lora, placement, generator) and training.py (grpo, reference, memory, data, run) under
one root whose `update` is the one path every edit takes (checked together, all or nothing, and
by a loaded Lab's guard, config/edits.py).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from ..checks.roles import check_roles
from ..errors import ConfigError, format_validation_error
from .fields import Section, canonical, resolve_aliases
from .models_and_devices import GeneratorSection, LoraSection, ModelSection, PlacementSection
from .training import DataSection, GRPOSection, MemorySection, ReferenceSection, RunSection


def _at(data: dict, path: str):
    """data['section']['field'] for 'section.field'."""
    section, _, name = path.partition(".")
    return data[section][name]


class LabConfig(Section):
    model: ModelSection
    lora: LoraSection = Field(default_factory=LoraSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    generator: GeneratorSection = Field(default_factory=GeneratorSection)
    grpo: GRPOSection = Field(default_factory=GRPOSection)
    reference: ReferenceSection = Field(default_factory=ReferenceSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    data: DataSection = Field(default_factory=DataSection)
    run: RunSection = Field(default_factory=RunSection)

    _guard: Any = PrivateAttr(None)  # a loaded Lab's edit guard: check(changes) before, apply(changes) after an update

    def attach_guard(self, guard) -> None:
        """A loaded Lab's edit guard (config/edits.py): from now on every edit is checked against what was built."""
        self._guard = guard

    def detach_guard(self) -> None:
        """Nothing loaded is left to protect: the config is a plain config again."""
        self._guard = None

    def model_post_init(self, context: Any) -> None:
        for name in type(self).model_fields:
            section = self.__dict__[name]
            section._root, section._name = self, name

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).model_fields:  # a whole section: every field of it, through update
            data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            if not isinstance(data, dict):
                raise ConfigError(f"{name}: got {value!r}; assign a {name} section (a mapping of its fields)")
            fields = type(self).model_fields[name].annotation.model_fields
            defaults = {k: f.get_default(call_default_factory=True) for k, f in fields.items() if not f.is_required()}
            # the section replaced, as pydantic does
            self.update({f"{name}.{k}": v for k, v in {**defaults, **data}.items()})
        else:
            super().__setattr__(name, value)

    def model_copy(self, *, update: Optional[dict] = None, deep: bool = False) -> "LabConfig":
        """A deep copy (sections are never shared between two configs: each belongs to one root), unguarded."""
        guard, self._guard = self._guard, None  # why: the guard holds loaded models (threads, locks): never copied
        try:
            copy = super().model_copy(update=update, deep=True)
        finally:
            self._guard = guard
        copy.model_post_init(None)
        return copy

    def update(self, changes: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Apply 'section.field' -> value edits all at once: validated with every cross-field check, then
        (when a loaded Lab guards this config) checked and applied by it; all or nothing. Returns
        {path: (old, new)} of the values that changed. The one path every way of editing takes."""
        data = self.to_dict()
        changes = {canonical(str(path)): value for path, value in changes.items()}
        for path, value in changes.items():
            section, _, name = str(path).partition(".")
            fields = type(self).model_fields
            if section not in fields or name not in fields[section].annotation.model_fields:
                raise ConfigError(f"{path}: unknown field; fields look like grpo.beta (see docs/config.md)")
            data[section][name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        try:
            new = parse_config(data)
        except ConfigError:
            if self._guard is not None:  # an edit that can never apply after load says so, not what else is wrong
                before = self.to_dict()
                self._guard.refuse_fixed([p for p in map(str, changes) if _at(data, p) != _at(before, p)])
            raise
        changed = {
            path: (getattr(getattr(self, s), f), getattr(getattr(new, s), f))
            for path, s, f in leaf_fields()
            if getattr(getattr(self, s), f) != getattr(getattr(new, s), f)
        }
        if not changed:
            return changed
        if self._guard is not None:
            self._guard.check(self, new, changed)
        saved = {path: old for path, (old, _) in changed.items()}
        self._write({path: new_value for path, (_, new_value) in changed.items()})
        if self._guard is not None:
            try:
                self._guard.apply(self, changed)
            except BaseException:
                self._write(saved)  # why: all or nothing; a rebuild that failed leaves the old values in force
                raise
        return changed

    def assign(self, other: "LabConfig") -> dict[str, tuple[Any, Any]]:
        """Take every field of `other` through `update` (only those that differ change; a loaded Lab refuses
        load-time ones): what assigning `lab.config` and loading a YAML into the editor do."""
        data = other.to_dict()
        return self.update({path: data[s][f] for path, s, f in leaf_fields()})

    def _write(self, values: dict[str, Any]) -> None:
        for path, value in values.items():
            section, _, name = path.partition(".")
            target = self.__dict__[section]
            target.__dict__[name] = value  # why not setattr: the values were validated together above
            target.__pydantic_fields_set__.add(name)

    @model_validator(mode="after")
    def _cross_checks(self):
        ref = self.reference
        if ref.strategy == "none" and self.grpo.beta > 0:
            raise ValueError(
                f"reference.strategy: 'none' needs grpo.beta = 0 (got {self.grpo.beta}); "
                "set beta: 0 or strategy: adapter-disabled"
            )
        check_roles(self)
        weights, scored = self.data.reward_weights, len(self.data.rewards) + len(self.data.reward_models)
        if weights is not None and len(weights) != scored:  # why the models too: TRL weighs them as functions
            raise ValueError(
                f"data.reward_weights: {len(weights)} weights for {scored} rewards (data.rewards, then "
                "data.reward_models); give one per reward"
            )
        g = self.grpo
        lo, hi = g.importance_sampling_clip_min, g.importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(
                f"grpo.importance_sampling_clip_min: {lo} is not below importance_sampling_clip_max = {hi}; "
                "lower it or raise the max"
            )
        if g.importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise ValueError(
                f"grpo.importance_sampling_clip_max: mode {g.importance_sampling_mode} needs a bound to clip "
                "to; set importance_sampling_clip_max (TRL's default is 3.0)"
            )
        if self.data.dataset == "arithmetic" and self.grpo.prompts_per_step > self.data.num_prompts:
            raise ValueError(
                f"grpo.prompts_per_step: {self.grpo.prompts_per_step} distinct prompts per step, but the arithmetic "
                f"set has data.num_prompts = {self.data.num_prompts}; lower it or raise data.num_prompts"
            )
        return self

    @property
    def reference_strategy(self) -> str:
        """reference.strategy with null resolved: adapter-disabled when beta > 0 (a free reference with LoRA), else
        none."""
        if self.reference.strategy is not None:
            return self.reference.strategy
        return "adapter-disabled" if self.grpo.beta > 0 else "none"

    @property
    def reference_device(self) -> str:
        """Where a reference copy lives: reference.device, else the learner's device."""
        return self.reference.device or self.placement.learner

    @property
    def epsilon_high(self) -> float:
        return self.grpo.epsilon_high if self.grpo.epsilon_high is not None else self.grpo.epsilon

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def leaf_fields() -> list[tuple[str, str, str]]:
    """Every leaf field as ('section.field', section, field), in schema order."""
    return [(f"{s}.{f}", s, f) for s, info in LabConfig.model_fields.items() for f in info.annotation.model_fields]


def field_when(path: str) -> str:
    """When a change of 'section.field' takes effect: 'live', 'rebuild' or 'load' (see WHEN)."""
    section, _, name = path.partition(".")
    info = LabConfig.model_fields[section].annotation.model_fields[name]
    return (info.json_schema_extra or {})["when"]


def field_planned(path: str) -> bool:
    """Whether the memory plan reads 'section.field' (declared with the field: knob(..., planned=True))."""
    section, _, name = path.partition(".")
    info = LabConfig.model_fields[section].annotation.model_fields[name]
    return bool((info.json_schema_extra or {}).get("planned"))


def parse_config(data: dict) -> LabConfig:
    """Validate a plain dict into a LabConfig; errors become one ConfigError naming the fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
    try:
        return LabConfig.model_validate(resolve_aliases(data))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
