"""Built-in reward checkers with verl's custom-reward signature.

Every checker is ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and
returns ``{"score", "acc"}``, 1.0 for a correct final answer and 0.0 otherwise (group-normalised
advantages depend only on the gap, and 0/1 keeps ``score == acc``); the trainer adds the overlong
penalty on top.
"""
from __future__ import annotations

import numbers
import re
from fractions import Fraction
from typing import Optional, Union

__all__ = [
    "math_compute_score",
    "arithmetic_compute_score",
    "default_compute_score",
    "extract_final_answer",
    "normalize_answer",
    "answers_match",
    "answer_text",
    "MATH_DATA_SOURCES",
    "ARITHMETIC_DATA_SOURCES",
]

MATH_DATA_SOURCES = (
    "gsm8k", "openai/gsm8k", "math", "lighteval/math", "digitallearninggmbh/math-lighteval",
    "dapo_math", "math_dapo", "dapo-math", "dapo-math-17k", "bytedtsinghua-sia/dapo-math-17k",
    "aime", "aime24", "aime25", "aime-2024",
)
ARITHMETIC_DATA_SOURCES = ("arithmetic",)


def _score(correct: bool) -> dict:
    return {"score": 1.0 if correct else 0.0, "acc": 1.0 if correct else 0.0}


# --------------------------------------------------------------------------- extraction
def _last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 5" (no braces) is valid LaTeX for a single token.
        m = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the response was cut off inside the box


# DAPO-Math-17k's format (verl's math_dapo): the last "Answer: x" (any case), x up to the end of its line.
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


def _answer_line(text: str) -> Optional[str]:
    """The value of the last ``Answer: x`` line: a ``\\boxed{}`` around it unwrapped, and of an
    equation (``x = 3``) its right-hand side, as verl's ``math_dapo`` reads it."""
    found = _ANSWER_LINE.findall(text)
    if not found:
        return None
    value = found[-1].strip()
    boxed = _last_boxed(value)
    if boxed is not None:
        value = boxed
    return value.rsplit("=", 1)[-1].strip() or None


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer of a solution: the last ``Answer: x`` line (DAPO-Math-17k's format; verl's
    ``math_dapo`` reads it first), else the last ``\\boxed{x}``, else the text after the last
    ``#### `` (GSM8K style, up to the end of that line); None when there is none of them.

    Only an explicit final answer counts: a response without one earns no reward, as in
    DAPO's strict checker, so the policy learns to state its answer.
    """
    if not isinstance(text, str):
        raise TypeError(f"solution_str must be a str, got {type(text).__name__}")
    line = _answer_line(text)
    if line is not None:
        return line
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    k = text.rfind("####")
    if k >= 0:
        line = text[k + 4:].strip().split("\n", 1)[0].strip()
        return line or None
    return None


# --------------------------------------------------------------------------- normalisation
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_FRAC_SHORT = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(e[+-]?\d+)?$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d*)?$")
_UNITS = ("dollars", "dollar", "cents", "units", "degrees", "percent", "meters", "cm", "km", "hours",
          "minutes", "seconds", "days")


def _to_number(s: str) -> Optional[Fraction]:
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if _NUMBER.match(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = re.match(r"^([+-]?\d+)\s*/\s*([+-]?\d+)$", s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = _FRAC.match(s) or _FRAC_SHORT.match(s)
    if m:
        num, den = _to_number(m.group(2).strip()), _to_number(m.group(3).strip())
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if m.group(1) else value
    return None


def normalize_answer(answer: str) -> Union[Fraction, str]:
    """Canonical form of a final answer: a :class:`~fractions.Fraction` when it is a number
    (``"1,000"``, ``"1000.0"``, ``"\\frac{1}{2}"``, ``"0.5"``, ``"$5"``, ``"50\\%"``'s 50),
    else a whitespace- and LaTeX-decoration-free string."""
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    s = answer.strip()
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "\\%", "%", "^\\circ", "^{\\circ}"):
        s = s.replace(token, "")
    s = s.strip().rstrip(".").strip()
    low = s.lower()
    for unit in _UNITS:
        if low.endswith(" " + unit):
            s = s[: -len(unit) - 1].strip()
            break
    if s.startswith("x=") or s.startswith("x ="):
        s = s.split("=", 1)[1].strip()
    number = _to_number(s.replace(" ", ""))
    if number is not None:
        return number
    return re.sub(r"\s+", "", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def answers_match(pred: Optional[str], truth: str) -> bool:
    """True when two final answers are equal after :func:`normalize_answer`."""
    if pred is None:
        return False
    p, t = normalize_answer(pred), normalize_answer(truth)
    if isinstance(p, Fraction) != isinstance(t, Fraction):
        return False
    return p == t


def answer_text(value) -> str:
    """An answer cell as text; a number written canonically, so that a float column's 3.0 reads
    "3" as an int column's 3 does (``str(3.0)`` would be "3.0", which no integer answer equals)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _ground_truth(ground_truth) -> str:
    if isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, bool):
        return answer_text(ground_truth)
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth must be a str, got {type(ground_truth).__name__}")
    # GSM8K's `answer` column is the whole worked solution ending in "#### 72".
    if "####" in ground_truth or "\\boxed" in ground_truth:
        extracted = extract_final_answer(ground_truth)
        if extracted is not None:
            return extracted
    return ground_truth


# --------------------------------------------------------------------------- checkers
def math_compute_score(data_source: str, solution_str: str, ground_truth: str,
                       extra_info: Optional[dict] = None) -> dict:
    """Math checker: the response's final ``\\boxed{x}`` or ``#### x`` equals the ground
    truth up to numeric / fraction normalisation (``"1,000" == "1000"``, ``"0.5" == "1/2"``)."""
    pred = extract_final_answer(solution_str)
    return _score(answers_match(pred, _ground_truth(ground_truth)))


def arithmetic_compute_score(data_source: str, solution_str: str, ground_truth: str,
                             extra_info: Optional[dict] = None) -> dict:
    """The demo task's checker: the response (up to its end-of-text) is exactly the number.

    The demo model answers with digits and a stop token, so anything else (spaces inside
    the number, a second line, extra zeros, a missing answer) is wrong; only leading and
    trailing whitespace is ignored. Digits are compared as written, not as integers: the
    demo writes numbers least-significant digit first, where "061" (160) is not "61".
    """
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    truth = _ground_truth(ground_truth).strip()
    # An integer written with a zero fraction ("3.0", a float column's cell as text) is that integer.
    truth = re.sub(r"^(-?\d+)\.0+$", r"\1", truth)
    pred = solution_str.strip()
    return _score(bool(re.fullmatch(r"-?\d+", pred)) and pred == truth)


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: Optional[dict] = None) -> dict:
    """Dispatch on ``data_source``: ``"arithmetic"`` -> the demo checker; GSM8K / MATH /
    DAPO-Math / AIME names (verl's spellings, case-insensitive) -> the math checker."""
    if not isinstance(data_source, str):
        raise TypeError(f"data_source must be a str, got {type(data_source).__name__}")
    key = data_source.strip().lower()
    if key in ARITHMETIC_DATA_SOURCES or key.startswith("arithmetic/"):
        return arithmetic_compute_score(data_source, solution_str, ground_truth, extra_info)
    if key in MATH_DATA_SOURCES or key.split("/")[0] in MATH_DATA_SOURCES:
        return math_compute_score(data_source, solution_str, ground_truth, extra_info)
    raise ValueError(
        f"data_source {data_source!r} has no built-in reward; known: "
        f"{', '.join(ARITHMETIC_DATA_SOURCES + MATH_DATA_SOURCES)}. Set custom_reward_function.path "
        f"to score it with your own function")
