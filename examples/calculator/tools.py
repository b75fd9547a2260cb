"""The calculator example's tools: every ``@tool`` function of this module is a tool the model
may call (its type hints and docstring are the JSON schema the model sees)."""

import ast
import operator

from agentrl_fast.harness import tool

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    """Numbers, + - * / and parentheses only: anything else (names, calls, powers) is refused,
    so no code the model writes ever runs."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def _show(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


@tool(inline=True)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression, for example "(12 + 30) * 4 / 3".
    """
    if len(expression) > 200:
        raise ValueError("the expression is too long (at most 200 characters)")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return _show(_evaluate(tree.body))


@tool(inline=True)
def round_number(value: float, digits: int = 0) -> str:
    """Round a number to a number of decimal digits.

    Args:
        value: The number to round.
        digits: How many digits after the decimal point to keep.
    """
    return _show(round(value, digits))
