"""Tools as TRL 1.16 takes them: plain Python functions, sync or `async def`, with type hints and a docstring, whose
JSON schemas (transformers.utils.get_json_schema) the chat template renders into the prompt. Calling them follows
TRL's `_tool_call_loop`: an unknown tool, a call that is not a function call or a tool that raises gives the result
`{"error": ...}` and the rollout goes on; the synchronous calls of a turn run in order, then its async ones together.

Departs from TRL: the model's arguments are checked against the tool's schema (names, required ones, JSON types)
before the call, where TRL calls `fn(**arguments)` and lets the tool meet them; and a tool that does not return within
`generator.tool_timeout_s` gets an error result (TRL waits for ever). A hung synchronous tool's thread is left behind
(Python cannot stop a thread); an async one is cancelled. Nothing the model writes is evaluated: its arguments are
JSON values handed to the functions given here.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from ..algo.reward_calls import is_async_callable, run_coroutine
from ..errors import LabError

# JSON schema types (get_json_schema's) -> what a parsed argument of that type is in Python
JSON_TYPES: dict[str, Callable[[object], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def tool_schema(fn: Callable) -> dict:
    """`fn`'s JSON schema as the chat template renders it; a function without type hints or a docstring describing
    each parameter is one line naming it and the parameter."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        return get_json_schema(fn)
    except (TypeHintParsingException, DocstringParsingException) as err:
        raise LabError(
            f"tools: {name}: {err}; give every parameter a type hint and a docstring with an 'Args:' line for "
            "each (transformers.utils.get_json_schema reads them)"
        ) from None


def argument_error(arguments, schema: dict) -> str:
    """Why `arguments` do not fit the tool's parameters ('' when they do): unknown or missing names, wrong JSON
    types."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = schema["function"].get("parameters", {})
    properties = params.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        return f"unknown argument(s) {unknown}; the tool takes {sorted(properties)}"
    missing = [p for p in params.get("required", []) if p not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
        if not fits(value, properties[key]):
            return f"argument {key!r} is {type(value).__name__} {value!r}, the tool takes {properties[key].get('type')}"
    return ""


def fits(value, schema: dict) -> bool:
    """Whether a JSON value has the schema's type (a list of types: any of them; nullable: None too; array items
    checked)."""
    if value is None and schema.get("nullable"):
        return True
    kinds = schema.get("type")
    if kinds is None:  # no type (typing.Any): anything
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if not any(JSON_TYPES.get(k, lambda v: True)(value) for k in kinds):
        return False
    items = schema.get("items")
    return not (isinstance(value, list) and items) or all(fits(v, items) for v in value)


class Toolbox:
    """The run's tools by name, their schemas (what the prompt renders) and how a turn's calls run."""

    def __init__(self, tools: list[Callable]):
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for fn in tools:
            if not callable(fn):
                raise LabError(f"tools: {fn!r} is not callable; pass plain Python functions (sync or async def)")
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self.functions:
                raise LabError(f"tools: two tools are named {name!r}; each tool needs its own function name")
            self.functions[name] = fn
            self.schemas.append(schema)
        self.by_name = {s["function"]["name"]: s for s in self.schemas}

    def __len__(self) -> int:
        return len(self.functions)

    def run_calls(self, calls: list[dict], timeout_s: float) -> tuple[list[tuple[str, object]], int]:
        """One assistant turn's tool calls: [(tool name, result)] in TRL's order (the synchronous calls in turn, then
        the async ones, gathered) and how many failed (their result is {"error": ...})."""
        results, pending = [], []  # (name, result, failed)
        for call in calls:
            name, fn, arguments, error = self.resolve(call)
            if error:
                results.append((name, {"error": error}, True))
            elif is_async_callable(fn):
                pending.append((name, fn, arguments))
            else:
                results.append((name, *call_with_timeout(name, fn, arguments, timeout_s)))
        if pending:
            results.extend(run_coroutine(gather_with_timeout(pending, timeout_s)))
        return [(name, result) for name, result, _ in results], sum(failed for *_, failed in results)

    def resolve(self, call: dict) -> tuple[str, Callable, dict, str]:
        """(name, function, arguments, error): the error is '' for a call that may run."""
        if call.get("type", "function") != "function":  # TRL: "Unsupported tool call type"
            return call.get("name", "unknown"), None, {}, f"Unsupported tool call type: {call.get('type')}"
        function = call.get("function", call)
        name, arguments = function.get("name", "unknown"), function.get("arguments", {})
        if name not in self.functions:
            return name, None, {}, f"Tool {name} not found."  # TRL's words
        return name, self.functions[name], arguments, argument_error(arguments, self.by_name[name])


def call_with_timeout(name: str, fn: Callable, arguments: dict, timeout_s: float) -> tuple[object, bool]:
    """`fn(**arguments)` on a thread of its own, waited for `timeout_s`: (its result, False), or ({"error": ...}, True)
    when it raised or did not return (why a thread: a hung tool must not hang the notebook; it is left running, a
    daemon)."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn(**arguments), False
        except Exception as err:  # why every Exception: a tool's failure is the model's to read, as in TRL
            box["out"] = {"error": str(err)}, True

    worker = threading.Thread(target=target, name=f"grpo-lab-tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return {"error": timed_out(name, timeout_s)}, True
    return box["out"]


async def gather_with_timeout(pending: list[tuple[str, Callable, dict]], timeout_s: float) -> list[tuple]:
    """The async calls together, each cancelled after `timeout_s`: (name, result, failed); a raise or a timeout is
    its {"error": ...}."""

    async def one(name, fn, arguments):
        try:
            return name, await asyncio.wait_for(fn(**arguments), timeout_s), False
        except asyncio.TimeoutError:
            return name, {"error": timed_out(name, timeout_s)}, True
        except Exception as err:
            return name, {"error": str(err)}, True

    return list(await asyncio.gather(*(one(*p) for p in pending)))


def timed_out(name: str, timeout_s: float) -> str:
    return f"Tool {name} did not return within {timeout_s:g} s (generator.tool_timeout_s)."
