"""Shared fixtures: one tiny local checkpoint per session, and configs pointing at it."""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# why: a local Ray binds the machine's interface address unless told otherwise; tests talk to loopback only
# (read when ray is imported, so before any test imports it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """A per-session GRPO_LAB_CACHE (inherited by every subprocess and notebook kernel), so tests never
    touch the user's cache; the built-in models are built there once per session. scripts/test.sh names one for
    all its pytest processes (GRPO_LAB_TEST_CACHE): why: each built-in model is then built once per suite, not once
    per worker and pass (the trained one takes minutes on one thread; builds take a file lock, so two wait)."""
    shared = os.environ.get("GRPO_LAB_TEST_CACHE")
    path = Path(shared) if shared else tmp_path_factory.mktemp("user-cache")
    os.environ["GRPO_LAB_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(user_cache):
    """The random-weight tiny model (`builtin:tiny-random`, seed 0), built once per session: the suite's model.
    Why random, not the trained `builtin:tiny-qwen2`: near-flat logits and EOS at ~10% a token give every test
    varied completion lengths and sampling that differs by knob; the presets and the demo use the trained one."""
    from grpo_lab.models.source import resolve_model_path

    return resolve_model_path("builtin:tiny-random")


@pytest.fixture
def tiny_config(tiny_model):
    """A small, fast config dict for the tiny model (float32 compute for exact comparisons)."""
    return partial(tiny_dict, tiny_model)


def tiny_dict(tiny_model: str, **sections) -> dict:
    """tiny_config's dict: 16-token completions, 2 prompts x 4 generations; `sections` update it section by section."""
    cfg = {
        "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
        "lora": {"r": 8, "lora_alpha": 16},
        "generator": {"max_completion_length": 16, "max_prompt_length": 128},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-3},
        "data": {"rewards": ["exact_answer", "format", "length"]},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.fixture
def python_sigint():
    """SIGINT as Python sets it when started from a terminal (Ctrl-C raises KeyboardInterrupt), for the tests that send
    one. Why: a process a non-interactive shell starts in the background (`cmd &`, nohup, some CI runners) inherits
    SIGINT ignored, and Python keeps it ignored, so their Ctrl-C never arrived (4 tests failed so)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def loaded_lab(tiny_config):
    from grpo_lab import Lab

    def make(**sections):
        return Lab(tiny_config(**sections)).load()

    return make


@pytest.fixture(scope="module")
def shared():
    """State a test module builds once (e.g. a loaded Lab under "lab", closed at the module's end)."""
    state = {}
    yield state
    if "lab" in state:
        state["lab"].close()


@pytest.fixture
def ray_local(request):
    """A local Ray for the session's sharded Labs (a Lab uses a Ray already up, as in a notebook that called
    ray.init): starting one per Lab costs seconds each. Started once per module (shut down at its end, or by a test
    that needs a cluster of its own); the CLI tests start their own, in their own process."""
    import ray

    if not ray.is_initialized():
        from grpo_lab.execution.sharded.ray_cluster import start_local

        start_local(cpus=2)
    return ray


@pytest.fixture(scope="module", autouse=True)
def _no_ray_beyond_its_module():
    """A Ray a test module started is shut down at the module's end. Why: its driver threads in this process make
    torch's OpenMP threads wait on a 2-core machine, and every later module's torch work ran several times slower."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """The modules with the most `slow` tests first, each module's tests kept together and in their order. Why: the
    xdist pass hands ungrouped tests out in this order (its groups first, the most tests first: xdist's own reorder),
    and a minutes-long test collected last ran alone at the end of the pass while the other worker idled
    (test_wheel.py, 166 s, on a fresh clone at 89453da)."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.nodeid.split("::")[0]] = slow.get(item.nodeid.split("::")[0], 0) + bool(
            item.get_closest_marker("slow")
        )
    first_seen = {module: i for i, module in reversed(list(enumerate(item.nodeid.split("::")[0] for item in items)))}
    items.sort(key=lambda item: (-slow[item.nodeid.split("::")[0]], first_seen[item.nodeid.split("::")[0]]))
    solo = [i for i in items if i.get_closest_marker("solo")]
    unsaid = sorted(str(path) for path in {i.path for i in solo} if "pytest.mark.solo" not in path.read_text())
    if unsaid:  # why: scripts/test.sh's solo and alone passes collect only the modules that say pytest.mark.solo
        raise pytest.UsageError(f"a module with solo tests must say pytest.mark.solo in its text: {unsaid}")
    skip_beyond_the_cores(items)
    unpaired = [i.nodeid for i in solo if not placed_in_solo_pass(i)]
    if unpaired:  # why: the solo pass runs two workers; a solo test outside a kind's group could land anywhere
        raise pytest.UsageError(f"solo tests need xdist_group 'ranks' or 'browser', or the alone mark: {unpaired}")


def skip_beyond_the_cores(items) -> None:
    """A test marked cores(n) is skipped on a machine with fewer usable cores, saying so: the Lab refuses n CPU
    ranks on fewer cores (tests/test_sharded.py checks that line), so on a 1-core machine the suite still passes."""
    from grpo_lab.checks.world import usable_cpus

    have = usable_cpus()
    for item in items:
        mark = item.get_closest_marker("cores")
        if mark is not None and have < mark.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {mark.args[0]} usable CPU cores (CPU ranks); {have} here"))


# scripts/test.sh's solo pass: one worker each. Why the ranks' modules one at a time: tried two at a time, a fresh
# clone's solo pass took no less (8:52 against 9:03; it is CPU-bound) and one module's cleanup could reach the other's
# Ray (test_ray.py's killed driver once killed every Ray process new on the machine)
SOLO_GROUPS = ("ranks", "browser")


def placed_in_solo_pass(item) -> bool:
    group = item.get_closest_marker("xdist_group")
    name = group.args[0] if group is not None and group.args else None
    return bool(item.get_closest_marker("alone")) or name in SOLO_GROUPS
