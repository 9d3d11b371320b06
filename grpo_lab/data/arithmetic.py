"""The built-in arithmetic set: integer word problems made in memory (no download), the same for the same seed. As
a dataset its prompts are chat messages (TRL's conversational format), so TRL's conversational rewards run on it."""

from __future__ import annotations

import random

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


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` problems as dataset rows: the prompt as the set's system message (SYSTEM_PROMPT: how to give the answer) and
    one user message, the answer as text."""
    system = {"role": "system", "content": SYSTEM_PROMPT}
    return [
        {"prompt": [system, {"role": "user", "content": row["prompt"]}], "answer": row["answer"]}
        for row in arithmetic_problems(n, seed)
    ]
