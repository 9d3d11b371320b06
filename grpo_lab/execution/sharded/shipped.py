"""A sharded Lab's tools on its ranks. Each rank runs the tool loop on the rows it samples (generation/sample_once.py),
so each rank's Lab holds the tools too: those the config names ('module:function' in generator.tools and
generator.environment_factory) each rank imports by name; those passed to the Lab as Python objects
(`Lab(tools=[...], environment_factory=...)`) travel to the ranks pickled (cloudpickle, as Ray sends a task's
function), checked here at construction: one that cannot be pickled is one line naming it and the fix.
"""

from __future__ import annotations

from typing import Callable, Optional

from ...errors import LabError


def name_of(obj) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def pickled(obj, field: str, fix: str) -> bytes:
    """`obj` as the ranks receive it; one line naming it and the fix when it cannot travel."""
    import cloudpickle

    try:
        return cloudpickle.dumps(obj)
    except Exception as err:  # why every Exception: pickling raises TypeError, PicklingError, AttributeError...
        raise LabError(
            f"{field}: {name_of(obj)} cannot be pickled to reach a sharded learner's ranks ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else 'no reason given'}); {fix}"
        ) from None


def shipped(tools) -> Optional[bytes]:
    """What the driver sends every rank of the Lab's own tools and environment_factory (tools.Tools.given), pickled;
    None when the config names them all (each rank imports them itself)."""
    import cloudpickle

    if tools is None or tools.given == (None, None):
        return None
    given, factory = tools.given
    fix = "name it by import path in generator.tools ('module:function') or make it picklable"
    for fn in given or []:
        pickled(fn, "tools", fix)  # why one by one: the line names the tool that cannot travel
    if factory is not None:
        env_fix = "name it by import path in generator.environment_factory ('module:Class') or make it picklable"
        for make in factory.values() if isinstance(factory, dict) else [factory]:
            pickled(make, "environment_factory", env_fix)
    return cloudpickle.dumps({"tools": list(given) if given is not None else None, "environment_factory": factory})


def unshipped(data: Optional[bytes]) -> dict[str, Callable]:
    """A rank's Lab's keyword arguments from what the driver shipped (nothing: none)."""
    import pickle

    if data is None:
        return {}
    return {k: v for k, v in pickle.loads(data).items() if v is not None}
