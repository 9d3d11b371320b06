"""Config edits on a loaded Lab. Every field declares when it takes effect (config/fields.py's WHEN):

- live: read at the next phase that uses it (nothing to do here);
- rebuild: the part that depends on it is rebuilt at once, by the function REBUILDS names;
- load: refused after load with one line (the models were built from it: make a new Lab).

Every way of editing (attribute assignment on lab.config, lab.configure, the widget editor,
assigning lab.config) reaches `LabConfig.update`, which calls this guard: `check` before any
value changes (refusals), `apply` after (rebuilds; a failure puts the old values back).
"""

from __future__ import annotations

from typing import Callable

from ..errors import LabError
from .schema import field_when


def rebuild_reference(loaded: "LoadedLabGuard") -> None:
    executor = loaded.executor
    if executor.config.reference_strategy != executor.reference_strategy:  # why: 'copy' loads a model; only on a change
        executor.build_reference()


def rebuild_rewards(loaded: "LoadedLabGuard") -> None:
    from ..algo.rewards import resolve_reward

    loaded.executor.reward_funcs = [resolve_reward(name) for name in loaded.executor.config.data.rewards]


def rebuild_leak_detector(loaded: "LoadedLabGuard") -> None:
    memory = loaded.executor.config.memory
    loaded.leaks.window = memory.leak_window
    loaded.leaks.min_growth = memory.leak_min_growth_mib * 1024**2


def rebuild_prompts(loaded: "LoadedLabGuard") -> None:
    loaded.executor.build_prompts()  # (one function for every data field, so several edited at once build once)


# (a sharded learner's driver rebuilds its memory views; its ranks their own parts, at their next command)
REBUILDS: dict[str, Callable] = {
    "grpo.beta": rebuild_reference,
    "reference.strategy": rebuild_reference,
    **{
        f"data.{name}": rebuild_prompts
        for name in ("dataset", "dataset_config", "split", "streaming", "num_prompts", "system_prompt")
    },
    "data.rewards": rebuild_rewards,
    "data.reward_models": lambda loaded: loaded.executor.build_reward_models(),
    "memory.sample_hz": lambda loaded: loaded.memory.set_rate(loaded.executor.config.memory.sample_hz),
    "memory.host_threshold": lambda loaded: setattr(
        loaded.memory, "host_threshold", loaded.executor.config.memory.host_threshold
    ),
    "memory.leak_window": rebuild_leak_detector,
    "memory.leak_min_growth_mib": rebuild_leak_detector,
}


class LoadedLabGuard:
    """Installed on a Lab's config by `Lab.load()`: what was built from it (the executor's models, the memory sampler,
    the leak detector, the devices watched), never the Lab itself."""

    def __init__(self, executor, memory, leaks, memory_devices: list[str]):
        self.executor, self.memory, self.leaks, self.memory_devices = executor, memory, leaks, memory_devices

    def refuse_fixed(self, paths) -> None:
        """Load-time fields among `paths` are refused first: no other message can help an edit that never applies."""
        fixed = [path for path in paths if field_when(path) == "load"]
        if fixed:
            raise LabError(
                f"{', '.join(fixed)}: fixed when the Lab loads (the models, placement or engine were built "
                "from it); make a new Lab with the new value: lab.close(); lab = Lab(config).load()"
            )

    def check(self, config, new, changed: dict) -> None:
        self.refuse_fixed(changed)
        if "data.rewards" in changed and self.executor.rewards_given:
            raise LabError(
                "data.rewards: this Lab's reward functions were passed to Lab(reward_funcs=...); pass new "
                "ones to a new Lab, or edit data.reward_weights"
            )
        source = {"data.dataset", "data.dataset_config", "data.split", "data.streaming", "data.num_prompts"}
        if source & set(changed) and getattr(self.executor, "train_dataset", None) is not None:
            raise LabError(
                f"{', '.join(sorted(source & set(changed)))}: this Lab's data was passed to Lab(train_dataset=...); "
                "pass another dataset to a new Lab"
            )
        if "data.rewards" in changed:
            from ..algo.rewards import resolve_reward

            for name in new.data.rewards:
                resolve_reward(name)
        if new.reference_strategy == "copy" and new.reference_device not in self.memory_devices:
            raise LabError(
                f"reference.strategy: a copy on {new.reference_device} after load would sit on a device this "
                f"Lab does not watch ({', '.join(self.memory_devices)}); make a new Lab with it"
            )
        self.executor.check_live(new)

    def apply(self, config, changed: dict) -> None:
        done = []
        for path in changed:
            rebuild = REBUILDS.get(path)
            if rebuild is not None and rebuild not in done:
                rebuild(self)
                done.append(rebuild)
