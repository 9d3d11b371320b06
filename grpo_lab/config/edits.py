"""Config edits on a loaded Lab. Every field declares when it takes effect (config.WHEN):

- live: read at the next phase that uses it (nothing to do here);
- rebuild: the part that depends on it is rebuilt at once, by the function REBUILDS names;
- load: refused after load with one line (the models were built from it: make a new Lab).

Every way of editing (attribute assignment on lab.config, lab.configure, the widget editor,
assigning lab.config) reaches `LabConfig.update`, which calls this guard: `check` before any
value changes (refusals), `apply` after (rebuilds; a failure puts the old values back).
"""
from __future__ import annotations

from typing import Callable

from .schema import field_when
from ..errors import LabError


def rebuild_reference(lab) -> None:
    if lab.config.reference_strategy != lab.executor.reference_strategy:   # why: 'copy' loads a model; only on a change
        lab.executor.build_reference()


def rebuild_prompts(lab) -> None:
    lab.executor.build_prompts()


def rebuild_rewards(lab) -> None:
    from ..algo.rewards import resolve_reward

    lab.reward_funcs = [resolve_reward(name) for name in lab.config.data.rewards]


def rebuild_leak_detector(lab) -> None:
    lab.leaks.window = lab.config.memory.leak_window
    lab.leaks.min_growth = lab.config.memory.leak_min_growth_mib * 1024 ** 2


REBUILDS: dict[str, Callable] = {
    "grpo.beta": rebuild_reference,
    "reference.strategy": rebuild_reference,
    "data.dataset": rebuild_prompts,
    "data.num_prompts": rebuild_prompts,
    "data.system_prompt": rebuild_prompts,
    "data.rewards": rebuild_rewards,
    "memory.sample_hz": lambda lab: lab.memory.set_rate(lab.config.memory.sample_hz),
    "memory.host_threshold": lambda lab: setattr(lab.memory, "host_threshold", lab.config.memory.host_threshold),
    "memory.leak_window": rebuild_leak_detector,
    "memory.leak_min_growth_mib": rebuild_leak_detector,
}


class LoadedLabGuard:
    """Installed on a Lab's config by `Lab.load()`."""

    def __init__(self, lab):
        self.lab = lab

    def refuse_fixed(self, paths) -> None:
        """Load-time fields among `paths` are refused first: no other message can help an edit that never applies."""
        fixed = [path for path in paths if field_when(path) == "load"]
        if fixed:
            raise LabError(f"{', '.join(fixed)}: fixed when the Lab loads (the models, placement or engine were built "
                           "from it); make a new Lab with the new value: lab.close(); lab = Lab(config).load()")

    def check(self, config, new, changed: dict) -> None:
        self.refuse_fixed(changed)
        lab = self.lab
        if "data.rewards" in changed and lab.reward_funcs_given:
            raise LabError("data.rewards: this Lab's reward functions were passed to Lab(reward_funcs=...); pass new "
                           "ones to a new Lab, or edit data.reward_weights")
        if "data.rewards" in changed:
            from ..algo.rewards import resolve_reward

            for name in new.data.rewards:
                resolve_reward(name)
        if new.reference_strategy == "copy" and new.reference_device not in lab.memory_devices:
            raise LabError(f"reference.strategy: a copy on {new.reference_device} after load would sit on a device this "
                           f"Lab does not watch ({', '.join(lab.memory_devices)}); make a new Lab with it")
        lab.executor.check_live(new)

    def apply(self, config, changed: dict) -> None:
        done = []
        for path in changed:
            rebuild = REBUILDS.get(path)
            # (a sharded learner's ranks rebuild their own parts at their next command; the driver its memory views)
            if rebuild is not None and rebuild not in done and self.lab.executor.rebuilds_here(path):
                rebuild(self.lab)
                done.append(rebuild)
