"""The built-in demo task: digit problems generated on the fly from a seed.

A problem is a prompt such as ``"sort:52817="`` (answer ``"12578"``) or, with the
arithmetic operations enabled, ``"482+037="``; the model answers with digits and an
end-of-text token, and the demo checker
(:func:`dapo_trainer.rewards.arithmetic_compute_score`) gives 1 for the exact digits.

The default is sorting: a 2-layer model learns it fast enough on a CPU that a short
warm start lands in the middle of its learning curve (partly right, so RL gets groups
with both right and wrong answers). Multi-digit addition learns too slowly for the
10-minute budget (benchmarks/RESULTS.md, "Design figures moved from code comments").

The held-out evaluation set is drawn from its own seed and every problem in it is
excluded from the training stream, so "held-out accuracy" is measured on problems the
model never saw, in warm-start or in RL.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Set

__all__ = ["TaskConfig", "Problem", "sample_problem", "make_split", "write_jsonl", "CHARSET", "DATA_SOURCE"]

DATA_SOURCE = "arithmetic"
# Every character a prompt or an answer can contain (the character tokenizer's vocabulary).
CHARSET = "0123456789+-*=sort:"
OPS = ("sort", "+", "-", "*")


@dataclass(frozen=True)
class TaskConfig:
    """Which problems the task draws.

    Attributes:
        max_digits: operands of ``+`` and ``-`` have 1..max_digits digits.
        mul_digits: ``*`` multiplies a number of up to ``mul_digits`` digits by one digit.
        ops: the operations drawn, uniformly: "sort" (the digits of a random string of
            ``sort_len`` digits, ascending), "+", "-", "*".
        sort_len: (shortest, longest) digit string for "sort".
        little_endian: write every number least-significant digit first ("74+58=" is
            47 + 85 and its answer "231" is 132). Digits then come out in the order a
            carry propagates, which lets a 2-layer model learn the task in a few hundred
            steps instead of thousands (Lee et al., 2023, "Teaching Arithmetic to Small
            Transformers").
        fixed_width: zero-pad operands to ``max_digits`` (``mul_digits`` / 1 for ``*``)
            and answers to one digit more, so digit ``i`` of each number always sits at
            the same offset and a small model aligns them by position alone.
    """

    max_digits: int = 3
    mul_digits: int = 2
    ops: tuple = ("sort",)
    sort_len: tuple = (4, 7)
    little_endian: bool = True
    fixed_width: bool = True

    def __post_init__(self):
        for name in ("max_digits", "mul_digits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 9:
                raise ValueError(f"TaskConfig.{name} must be an int in [1, 9], got {v!r}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"TaskConfig.ops must be a non-empty subset of {OPS}, got {self.ops!r}")
        lo, hi = self.sort_len
        if not 1 <= lo <= hi <= 20:
            raise ValueError(f"TaskConfig.sort_len must be (lo, hi) with 1 <= lo <= hi <= 20, got {self.sort_len!r}")

    def to_dict(self) -> dict:
        return {**asdict(self), "ops": list(self.ops), "sort_len": list(self.sort_len)}


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str

    def row(self) -> Dict[str, str]:
        """The trainer's data row (``dapo_trainer.data`` columns)."""
        return {"prompt": self.prompt, "answer": self.answer, "data_source": DATA_SOURCE}


def _operand(rng: random.Random, max_digits: int) -> int:
    # Draw the digit count first so short and long operands are equally common (a
    # uniform draw over 0..999 would make 3-digit numbers 90% of the data).
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def sample_problem(rng: random.Random, task: TaskConfig) -> Problem:
    """One problem drawn with ``rng``. Subtractions never go below zero."""
    op = rng.choice(task.ops)
    if op == "sort":
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(*task.sort_len)))
        return Problem(f"sort:{digits}=", "".join(sorted(digits)))
    if op == "*":
        a, b = _operand(rng, task.mul_digits), rng.randint(0, 9)
    else:
        a, b = _operand(rng, task.max_digits), _operand(rng, task.max_digits)
        if op == "-":
            a, b = max(a, b), min(a, b)
    c = a * b if op == "*" else a - b if op == "-" else a + b
    wa = task.mul_digits if op == "*" else task.max_digits
    wb = 1 if op == "*" else task.max_digits

    def w(x: int, width: int) -> str:
        s = str(x).zfill(width) if task.fixed_width else str(x)
        return s[::-1] if task.little_endian else s

    return Problem(f"{w(a, wa)}{op}{w(b, wb)}=", w(c, wa + 1))


def _stream(seed: int, task: TaskConfig, exclude: Set[str]) -> Iterator[Problem]:
    rng = random.Random(seed)
    while True:
        p = sample_problem(rng, task)
        if p.prompt not in exclude:
            yield p


def make_split(task: TaskConfig, seed: int, num_train: int, num_val: int) -> tuple:
    """``(train, val)`` lists of :class:`Problem`: ``val`` holds ``num_val`` distinct
    problems; ``train`` holds ``num_train`` problems (repeats allowed) none of which is in
    ``val``. Deterministic in ``(task, seed)``."""
    for name, v in (("num_train", num_train), ("num_val", num_val)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    val: List[Problem] = []
    seen: Set[str] = set()
    # Different seed streams for the two splits, so growing num_train never changes val.
    stream = _stream(seed * 2 + 1, task, exclude=set())
    tries = 0
    while len(val) < num_val:
        p = next(stream)
        tries += 1
        if tries > 100 * num_val + 1000:
            raise ValueError(f"num_val={num_val} exceeds the distinct problems this TaskConfig can draw")
        if p.prompt not in seen:
            seen.add(p.prompt)
            val.append(p)
    stream = _stream(seed * 2, task, exclude=seen)
    train = [next(stream) for _ in range(num_train)]
    return train, val


def write_jsonl(problems: List[Problem], path: str) -> None:
    """Write the rows atomically (temp file + rename), so a killed run leaves no half file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        for p in problems:
            f.write(json.dumps(p.row()) + "\n")
    os.replace(tmp, path)
