"""The built-in arithmetic set's tool: a calculator the `tiny-tools` preset gives the model (generator.tools). It reads
an expression of numbers, + - * / and parentheses with Python's `ast` and computes it node by node: nothing the model
writes is evaluated as code."""

from __future__ import annotations

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_MAGNITUDE = 1e12  # why: "9**9**9"-like blow-ups are refused by the grammar, a long product by this bound


def calculator(expression: str) -> str:
    """Compute an arithmetic expression.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. "15 * 8".
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"the result's magnitude passes {MAX_MAGNITUDE:g}")
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r} (numbers, + - * / and parentheses only)")
