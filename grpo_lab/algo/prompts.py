"""Prompts: a built-in arithmetic set (no download) and a JSONL loader, served in a seeded order."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

from ..errors import LabError
from .containers import PromptBatch

# (prompt template, its operation, the operation's symbol in a worked solution, the answer's unit)
_TEMPLATES = [
    (
        "{name} has {a} apples and buys {b} more. How many apples does {name} have now?",
        lambda a, b: a + b,
        "+",
        "apples",
    ),
    ("{name} had {a} marbles and gave away {b}. How many marbles are left?", lambda a, b: a - b, "-", "marbles"),
    ("A box holds {a} rows of {b} eggs. How many eggs are in the box?", lambda a, b: a * b, "*", "eggs"),
    ("{name} reads {a} pages a day for {b} days. How many pages is that?", lambda a, b: a * b, "*", "pages"),
    (
        "A train carries {a} people and {b} more get on. How many people are on the train?",
        lambda a, b: a + b,
        "+",
        "people",
    ),
]
_NAMES = ["Ann", "Bo", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
SYSTEM_PROMPT = "Solve the problem. Put only the final number inside <answer></answer>."


def arithmetic_problems(n: int, seed: int = 0, worked: bool = False) -> list[dict]:
    """`n` word problems with integer answers, the same for the same seed. `worked` adds each problem's worked
    solution ("5 * 3 = 15.") and the answer's unit ("eggs"), what the built-in tiny model is trained on."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        template, op, symbol, unit = rng.choice(_TEMPLATES)
        a, b = rng.randint(2, 20), rng.randint(1, 12)
        a = max(a, b)  # keep subtraction non-negative
        row = {"prompt": template.format(name=rng.choice(_NAMES), a=a, b=b), "answer": str(op(a, b))}
        if worked:
            row.update(solution=f"{a} {symbol} {b} = {op(a, b)}.", unit=unit)
        rows.append(row)
    return rows


def load_jsonl(path: str | Path) -> list[dict]:
    """Rows with a 'prompt' (text or chat messages) and optionally an 'answer' and other columns."""
    from ..checks.paths import read_text

    path = Path(path)
    if not path.exists():
        raise LabError(f"data.dataset: {str(path)!r} is neither 'arithmetic' nor an existing JSONL file")
    rows = []
    for i, line in enumerate(read_text(path, "data.dataset").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise LabError(f"data.dataset: {path}:{i} is not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise LabError(
                f'data.dataset: {path}:{i} has no \'prompt\' field; each line needs {{"prompt": ..., "answer": ...}}'
            )
        if not is_prompt(row["prompt"]):
            raise LabError(
                f"data.dataset: {path}:{i} 'prompt' is {type(row['prompt']).__name__} {str(row['prompt'])[:40]!r}; "
                "give "
                'non-empty text or a list of {"role": ..., "content": ...} messages'
            )
        rows.append(row)
    if not rows:
        raise LabError(f"data.dataset: {path} has no rows")
    return rows


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


def load_rows(dataset: str, num_prompts: int, seed: int) -> list[dict]:
    return arithmetic_problems(num_prompts, seed) if dataset == "arithmetic" else load_jsonl(dataset)


def format_prompt(tokenizer, prompt, system_prompt: Optional[str]) -> str:
    """Chat-template the prompt when the tokenizer has a template; plain text otherwise."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages) + "\n"


class PromptSource:
    """Serves batches of prompts in a seeded, reshuffled-every-epoch order."""

    def __init__(self, rows: list[dict], tokenizer, system_prompt: Optional[str], seed: int):
        self.rows, self.tokenizer, self.system_prompt = rows, tokenizer, system_prompt
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._before_last: Optional[dict] = None

    def state_dict(self) -> dict:
        """The data position: the shuffle RNG and what is left of this epoch's order (for checkpoints)."""
        return {"rng": self._rng.getstate(), "order": list(self._order)}

    def load_state_dict(self, state: dict) -> None:
        self._rng.setstate(state["rng"])
        self._order = list(state["order"])

    def longest(self, max_prompt_length: int) -> tuple[dict, int]:
        """(the row whose formatted prompt has the most tokens, that count): at most max_prompt_length, as a rollout
        cuts longer prompts."""

        def tokens(row):
            text = format_prompt(self.tokenizer, row["prompt"], self.system_prompt)
            return min(len(self.tokenizer(text, add_special_tokens=False)["input_ids"]), max_prompt_length)

        counted = [(tokens(row), i) for i, row in enumerate(self.rows)]
        count, index = max(counted, key=lambda c: c[0])  # (the first of equals, as max over the rows gave)
        return self.rows[index], count

    def rewind(self) -> None:
        """Back to before the last batch was drawn, so the next batch is that batch again (a redone step's)."""
        if self._before_last is not None:
            self.load_state_dict(self._before_last)

    def next_batch(self, size: int) -> PromptBatch:
        self._before_last = self.state_dict()
        picked = []
        while len(picked) < size:
            if not self._order:
                self._order = list(range(len(self.rows)))
                self._rng.shuffle(self._order)
            picked.append(self.rows[self._order.pop()])
        return self.batch_of(picked)

    def batch_of(self, picked: list[dict]) -> PromptBatch:
        """These rows as a batch: prompts formatted, answers as text, the other columns passed on."""
        extra_keys = sorted({k for r in picked for k in r} - {"prompt", "answer"})
        return PromptBatch(
            prompts=[format_prompt(self.tokenizer, r["prompt"], self.system_prompt) for r in picked],
            answers=[None if r.get("answer") is None else str(r["answer"]) for r in picked],
            extra={k: [r.get(k) for r in picked] for k in extra_keys},
        )
