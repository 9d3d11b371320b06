"""TRL's two prompt formats (standard: text; conversational: chat messages), as the rollout formats them with the
tokenizer's chat template and as reward functions get them."""

from __future__ import annotations

from typing import Optional, Union

from ..errors import LabError


def format_prompt(tokenizer, prompt, system_prompt: Optional[str], tools: Optional[list[dict]] = None) -> str:
    """Chat-template the prompt when the tokenizer has a template, with the tools' schemas (`tools`: JSON schemas, as
    the tool loop renders them); plain text otherwise."""
    messages = with_system(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}], system_prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages) + "\n"


def with_system(messages: list[dict], system_prompt: Optional[str]) -> list[dict]:
    """The messages with data.system_prompt as their system message, in place of their own; as they are for None (the
    dataset's prompts unchanged, as TRL reads them)."""
    if not system_prompt:
        return messages
    own = messages[:1] and messages[0].get("role") == "system"
    return [{"role": "system", "content": system_prompt}, *messages[1 if own else 0 :]]


def reward_prompt(prompt, system_prompt: Optional[str]):
    """A row's prompt as reward functions get it (TRL's `prompts`): a standard prompt's text as the dataset has it; a
    conversational one's messages, with the run's system prompt where one is set (the conversation the model saw)."""
    if not is_conversational(prompt) or not system_prompt:
        return prompt
    return with_system(list(prompt), system_prompt)


def check_prompt(prompt, index: int, field: str) -> None:
    if not is_prompt(prompt):
        raise LabError(
            f"{field}: row {index}'s 'prompt' is {type(prompt).__name__} {str(prompt)[:40]!r}; give non-empty text "
            '(standard) or a list of {"role": ..., "content": ...} messages (conversational)'
        )


def is_prompt(prompt) -> bool:
    """Non-empty text, or a non-empty list of chat messages with string 'role' and 'content'."""
    if isinstance(prompt, str):
        return bool(prompt.strip())
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    )


def is_conversational(prompt: Union[str, list]) -> bool:
    """TRL's conversational format: the prompt is a list of messages (trl.data_utils.is_conversational's test)."""
    return isinstance(prompt, list)
