"""A calculator whose answers grow, notebook 07's tool: each call answers with its result, then the tape of the
calculations it has made so far (the latest `keep`), one a line, as an agent's tool that returns its history does.
The same name, schema and arithmetic as data/calculator.py's, so `builtin:tiny-tools` calls it as it learned to; a
run's later calls get longer answers, and with them a longer context for the turn that reads them."""

from __future__ import annotations

from typing import Callable

from . import calculator as plain


def tape_calculator(keep: int = 48) -> Callable[[str], str]:
    """A fresh calculator with an empty tape (`.tape`: its lines), answering with at most the `keep` latest; pass it
    as Lab(tools=[...])."""
    tape: list[str] = []

    def calculator(expression: str) -> str:
        """Compute an arithmetic expression.

        Args:
            expression: Numbers with + - * / and parentheses, e.g. "15 * 8".
        """
        result = plain.calculator(expression)
        earlier = "\n".join(tape[-keep:])
        tape.append(f"{expression.strip()} = {result}")
        return f"{result}\ntape:\n{earlier}" if earlier else result

    calculator.tape = tape
    return calculator
