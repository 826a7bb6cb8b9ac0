"""The shipped tool-use task: integer arithmetic with a calculator tool.

Why this task: its reward is exact (1 if the final answer is the true value), a tool call is
necessary for the model (a model this small cannot do two-digit arithmetic in its head), and the
whole loop (prompt -> tool call -> tool result -> answer) fits in about 250 tokens, so a GRPO step
of 64 trajectories takes seconds on a laptop.

An episode, rendered by the engine's chat template:

    <|user|>What is 37+58?<|end|>
    <|assistant|><tool_call>{"name": "calc", "arguments": {"expr": "37+58"}}</tool_call><|end|>
    <|tool|>call_...
    95<|end|>
    <|assistant|>95<|end|>

The engine decides by rule that the first assistant turn is a tool call and the second is text
(`tool_choice: auto` with one tool round), and its grammar writes the envelope and the tool name.
What the model chooses, and so what RL can teach it, is the expression it passes (copying the
question's) and the answer it writes (copying the tool's result).

`evaluate` is a pure function. It runs in the actions service's sandbox (its source is sent as
the program of a SandboxFusion `/run_code` call, since the expression is model-written text) or,
with `task.tool: in_process`, in the caller's process; both give the same output for any input.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from dataclasses import dataclass

from libra.runtime.engine.tokenizer import (
    ChatMessage,
    Special,
    ToolCallText,
    encode,
    render_chat,
    render_message,
)

TOOL_NAME = "calc"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
OPS = ("+", "-", "*")


def evaluate(expr: str) -> str:
    """The calculator: integers, + - *, parentheses, unary minus. Self-contained (it is shipped
    as source to the sandbox), total (an error is a string, never an exception)."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**6:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = value(node.left), value(node.right)
            out = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
            if abs(out) >= 10**12:
                raise ValueError("result too large")
            return out
        raise ValueError("only integers, + - * and parentheses")

    if len(expr) > 64:
        return "error: expression too long"
    try:
        return str(value(ast.parse(expr.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"


def sandbox_program(expr: str) -> str:
    """The Python program the actions service runs for one tool call: `evaluate`'s own source."""
    return f"{inspect.getsource(evaluate)}\nprint(evaluate({json.dumps(expr)}))\n"


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt of the task: a GRPO group samples it several times."""

    id: str
    a: int
    op: str
    b: int
    template: str = "What is {expr}?"  # the user turn (task.prompt)
    system: str | None = None  # a system turn before it (task.system)
    answer_mode: str = "exact"  # exact | last_number (task.answer)

    @property
    def expr(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def question(self) -> str:
        return self.template.replace("{expr}", self.expr)

    @property
    def answer(self) -> str:
        return evaluate(self.expr)

    def messages(self) -> list[dict]:
        user = [{"role": "user", "content": self.question}]
        return [{"role": "system", "content": self.system}, *user] if self.system else user


_INT = re.compile(r"-?\d[\d,]*")


def final_answer(problem: Problem, text: str) -> str:
    """The answer a text gives: all of it (`exact`, the built-in model's task) or its last integer
    (`last_number`: a pretrained model writes sentences; thousands separators are dropped)."""
    if problem.answer_mode == "exact":
        return text.strip()
    found = _INT.findall(text)
    return found[-1].replace(",", "") if found else ""


def reward(problem: Problem, final_text: str | None) -> float:
    """1 if the final answer is exactly the true value (surrounding space ignored), else 0."""
    return 1.0 if final_text is not None and final_answer(problem, final_text) == problem.answer else 0.0


class ProblemStream:
    """Seeded problems, the same sequence for the same seed: operands in [lo, hi], ops + - *."""

    def __init__(self, seed: int, lo: int = 10, hi: int = 99, ops: str = "+-*", template: str = "What is {expr}?",
                 system: str | None = None, answer_mode: str = "exact"):  # fmt: skip
        self.rng, self.lo, self.hi, self.ops, self.n = random.Random(seed), lo, hi, ops, 0
        self.shape = (template, system, answer_mode)

    @classmethod
    def of(cls, seed: int, task) -> ProblemStream:
        """The stream of a `TaskConfig`."""
        return cls(seed, task.lo, task.hi, task.ops, task.prompt, task.system, task.answer)

    def next(self) -> Problem:
        r = self.rng
        p = Problem(
            f"p{self.n}",
            r.randint(self.lo, self.hi),
            r.choice(self.ops),
            r.randint(self.lo, self.hi),
            *self.shape,
        )
        self.n += 1
        return p


def call_id(rng: random.Random) -> str:
    """An id of the engine's shape (`call_` and 24 hex digits), drawn from `rng`."""
    return "call_" + "".join(rng.choice("0123456789abcdef") for _ in range(24))


def demonstration(problem: Problem, call_id: str = "call_0") -> tuple[list[int], list[int]]:
    """A correct episode's token ids and its loss mask (1 on the model's tokens), for the
    supervised warm-start. Rendered by the engine's template, as the live loop's turns are."""
    call = ToolCallText(TOOL_NAME, json.dumps({"expr": problem.expr}))
    prompt = render_chat([ChatMessage("user", problem.question)], [TOOL_SCHEMA])
    first = render_message(ChatMessage("assistant", "", (call,)))[1:-1]  # without role and END
    tool = [int(Special.END), *render_message(ChatMessage("tool", problem.answer, (), call_id))]
    second = [*encode(problem.answer), int(Special.END)]
    ids = [*prompt, *first, *tool, int(Special.ASSISTANT), *second]
    mask = [0] * len(prompt) + [1] * len(first) + [0] * (len(tool) + 1) + [1] * len(second)
    return ids, mask
