"""Countdown (single turn, language actions), as in RAGEN / TinyZero.

Given a list of numbers and a target, answer with an arithmetic expression (``+ - * /``, unary minus and
parentheses) that uses every number exactly once and equals the target. Scoring and termination are RAGEN's (from
TinyZero): the numbers in the answer must be exactly the given ones, each once, or the reward is 0; then 1.0 if the
expression equals the target, else the format score 0.1. Every answer ends the episode, and every answer is a valid
action (there is nothing else to do), so no format penalty applies on top.

Expressions are checked by a whitelist parser over :mod:`ast` and evaluated with exact fractions: never ``eval``.
Input is bounded in length before parsing, so hostile text (``__import__('os')``, ``9**9**9``, deep nesting,
megabytes, unicode digits) is rejected quickly and never raises.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction

from ragen_pl.envs.base import Env, StepResult, check_int, check_range

MAX_EXPRESSION_CHARS = 200
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() \t]*")  # ASCII only: unicode digits and letters never reach the parser
_NUMBER = re.compile(r"[0-9]+")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


class ExpressionError(ValueError):
    """The answer is not an allowed expression."""


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """Value and integer literals of a ``+ - * /`` expression.

    Raises:
        ExpressionError: anything outside the grammar, or a division by zero.
    """
    text = text.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(text):
        raise ExpressionError("expression must be non-empty ASCII digits, + - * / and parentheses")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError, ValueError) as err:
        raise ExpressionError(f"not an expression: {type(err).__name__}") from None
    literals: list[int] = []

    def walk(node: ast.AST, depth: int) -> Fraction:
        if depth > 64:
            raise ExpressionError("expression nested too deeply")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):  # "- 3 + 5 + 2"
            value = walk(node.operand, depth + 1)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ExpressionError("division by zero")
                return left / right
            op = _OPS.get(type(node.op))
            if op is not None:
                return op(left, right)
        raise ExpressionError(f"{type(node).__name__} is not allowed")

    try:
        value = walk(tree.body, 0)
    except RecursionError:
        raise ExpressionError("expression nested too deeply") from None
    return value, literals


class Countdown(Env):
    actions = None

    def __init__(
        self,
        num_numbers: int = 4,
        max_number: int = 100,
        max_target: int = 1000,
        correct_reward: float = 1.0,
        format_reward: float = 0.1,
        tag: str | None = None,
    ) -> None:
        """
        Args:
            num_numbers: how many numbers are given (all must be used).
            max_number: numbers are drawn from 1..max_number.
            max_target: targets lie in 1..max_target.
            correct_reward: reward for an expression equal to the target.
            format_reward: reward for an answer that uses every number once but misses the target (RAGEN: 0.1).
            tag: metrics tag (default ``Countdown``).
        """
        super().__init__(tag)
        check_int("num_numbers", num_numbers, 2, 8)
        check_int("max_number", max_number, 2)
        check_int("max_target", max_target, 1)
        check_range("format_reward", format_reward, 0.0, correct_reward)
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.correct_reward, self.format_reward = float(correct_reward), float(format_reward)
        self.numbers: list[int] = []
        self.target = 0
        self.solution = ""
        """One expression that reaches the target (for tests and demonstrations)."""
        self.answer: str | None = None
        self._done = False

    @property
    def instructions(self) -> str:
        return (
            "You are solving the Countdown puzzle. You should use the num list to create an equation that equals the "
            "target. Use every number exactly once, with + - * / and parentheses. Answer with the expression only, "
            "e.g. <answer>2 + 5 - 3</answer> for nums [3, 5, 2] and target 4."
        )

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            # Build the target from every number, in a random order, so that a solution using each once exists.
            order = rng.sample(numbers, len(numbers))
            value, expression = Fraction(order[0]), str(order[0])
            for n in order[1:]:
                op = rng.choice("+-*/")
                if op == "/" and value % n != 0:
                    op = "+"
                value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
                expression = f"({expression} {op} {n})"
            if value.denominator == 1 and 1 <= value <= self.max_target:
                break
        self.numbers, self.target, self.solution = numbers, int(value), expression
        self.answer, self._done = None, False
        return self.render()

    def state_key(self) -> tuple:
        """The numbers, the target and the answer given (None before it)."""
        return tuple(self.numbers), self.target, self.answer

    def render(self) -> str:
        state = f"Numbers: {self.numbers}. Target: {self.target}."
        return state if self.answer is None else f"{state} Your answer: {self.answer}"

    def expert_action(self) -> str:
        return self.solution

    def step(self, action: str) -> StepResult:
        if self._done:
            return self.invalid(self.render())
        self.answer, self._done = action.strip()[:MAX_EXPRESSION_CHARS], True
        reward = self.score(action)
        success = reward == self.correct_reward
        return self.render(), reward, True, {"success": success, "action_is_valid": True, "action_is_effective": reward > 0}

    def score(self, answer: str) -> float:
        """RAGEN's rule: 0 unless the answer's numbers are exactly the given ones; then correct or format score."""
        if len(answer) > MAX_EXPRESSION_CHARS or Counter(int(n) for n in _NUMBER.findall(answer)) != Counter(self.numbers):
            return 0.0
        try:
            value, _ = parse_expression(answer)
        except ExpressionError:
            return self.format_reward  # every number, once, but not a valid expression
        return self.correct_reward if value == self.target else self.format_reward
