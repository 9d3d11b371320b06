"""The chat template's side of a tool call, with TRL 1.16's helpers (trl.chat_template_utils): which template a run
uses (model.chat_template: the tokenizer's own, one TRL ships, or a .jinja file), whether it can run tools
(`supports_tool_calling`, `is_chat_template_prefix_preserving`), the response parser TRL's `add_response_schema` sets,
prompts rendered with the tools' schemas, and a tool message's tokens as TRL's `_get_tool_suffix_ids` cuts them.

Departs from TRL: a template that is not prefix-preserving is refused (TRL swaps in its training template).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import LabError

TRL_PREFIX = "trl:"  # model.chat_template: trl:NAME = trl/chat_templates/NAME.jinja
HOW = "set model.chat_template to one that can, e.g. trl:qwen2_5 (TRL's Qwen2.5 template) or a .jinja file"


def trl_templates_dir() -> Path:
    import trl

    return Path(trl.__file__).parent / "chat_templates"


def template_text(spec: str) -> str:
    """model.chat_template's text: trl:NAME (a template TRL ships) or a path to a Jinja file."""
    if spec.startswith(TRL_PREFIX):
        path = trl_templates_dir() / f"{spec[len(TRL_PREFIX) :]}.jinja"
        if not path.is_file():
            names = sorted(p.stem for p in trl_templates_dir().glob("*.jinja"))
            raise LabError(f"model.chat_template: TRL ships no template {spec!r}; use trl:NAME, NAME one of {names}")
        return path.read_text()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise LabError(f"model.chat_template: {spec!r} is not a file; give a .jinja file or trl:NAME, e.g. trl:qwen2_5")
    return path.read_text()


def use_chat_template(tokenizer, spec: Optional[str]) -> None:
    """Give the tokenizer model.chat_template (None: keep its own), before prompts are formatted with it."""
    if spec is not None:
        tokenizer.chat_template = template_text(spec)


def prepare_for_tools(tokenizer) -> None:
    """Check, at load, that the tokenizer's chat template can run tools as TRL's loop needs, and give it TRL's
    response parser (add_response_schema) unless it has one; each refusal is one line saying how to give one."""
    from trl.chat_template_utils import add_response_schema, is_chat_template_prefix_preserving, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        raise LabError(
            "tools: the tokenizer's chat template cannot render a tool-calling conversation (user -> assistant with "
            f"tool_calls -> tool); {HOW}"
        )
    if not is_chat_template_prefix_preserving(tokenizer):
        raise LabError(
            "tools: the tokenizer's chat template renders a turn differently once a tool message follows it (not "
            f"prefix-preserving), so tool results cannot be appended as tokens; {HOW}"
        )
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise LabError(
                "tools: TRL knows no response parser for this chat template, so tool calls cannot be read; set "
                f"tokenizer.response_template (transformers' response parsing), or {HOW}"
            ) from None


def render_prompt(tokenizer, messages: list[dict], schemas: list[dict]) -> str:
    """A conversation's prompt with the tools' schemas, as TRL renders it (`tools=... or None`)."""
    return tokenizer.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=True, tokenize=False)


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens that follow an assistant turn ending in EOS when `tool_messages` answer it, up to the next assistant
    header: TRL 1.16's `_get_tool_suffix_ids` (a dummy conversation rendered with and without them)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        dummy + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if ends:  # why: Qwen-style templates render "<|im_end|>\n"; the assistant's turn ends at its EOS
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise LabError("tools: the chat template's tool turn does not extend the assistant's turn; " + HOW)
    return full[len(prefix) :]


def parse(tokenizer, ids: list[int], prefix: list[int], schemas: list[dict]) -> dict:
    """One assistant turn as TRL reads it (trl.chat_template_utils.parse_response: its tool calls, typed by the
    schemas; a malformed one falls back to plain text)."""
    from trl.chat_template_utils import parse_response

    return parse_response(tokenizer, ids, prefix=prefix, tools=schemas)
