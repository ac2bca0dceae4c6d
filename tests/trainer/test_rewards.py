"""Reward checkers: math final-answer extraction and normalisation, the demo checker,
data_source dispatch, and user reward functions loaded by path."""
import random

import pytest

from dapo_trainer import rewards as R


@pytest.mark.parametrize("response, truth", [
    ("so the total is 1000.\n#### 1,000", "1000"),
    ("#### 1000", "1,000"),
    ("The answer is \\boxed{0.5}", "1/2"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("\\boxed{-\\frac{1}{4}}", "-0.25"),
    ("\\boxed{\\frac12}", "1/2"),
    ("\\boxed{$18$}", "18"),
    ("\\boxed{18.00}", "18"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{\\text{5 dollars}}", "5"),
    ("first \\boxed{3} then corrected: \\boxed{4}", "4"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\dfrac{\\sqrt{3}}{2}"),
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72"),  # GSM8K answer column
    ("#### 7", "\\boxed{7}"),
], ids=lambda v: v if len(v) < 24 else v[:21] + "...")
def test_math_correct(response, truth):
    out = R.math_compute_score("gsm8k", response, truth)
    assert out == {"score": 1.0, "acc": 1.0}


@pytest.mark.parametrize("response, truth", [
    ("#### 999", "1000"),
    ("the answer is 1000", "1000"),          # no explicit final answer
    ("\\boxed{1000", "1000"),                # cut off inside the box
    ("\\boxed{1/3}", "0.33"),
    ("\\boxed{x+1}", "x+2"),
    ("\\boxed{12}", "\\sqrt{12}"),
    ("", "0"),
], ids=["wrong-number", "no-final-answer", "unbalanced-box", "third-vs-0.33", "expr", "num-vs-expr", "empty"])
def test_math_wrong(response, truth):
    assert R.math_compute_score("math", response, truth) == {"score": 0.0, "acc": 0.0}


def test_math_random_numbers_roundtrip():
    """Random integers and fractions in several spellings all match their value."""
    for _ in range(200):
        n = random.randint(-10**6, 10**6)
        assert R.math_compute_score("math", f"#### {n:,}", str(n))["acc"] == 1.0
        assert R.math_compute_score("math", f"\\boxed{{{n}.0}}", f"{n:,}")["acc"] == 1.0
        assert R.math_compute_score("math", f"#### {n + 1}", str(n))["acc"] == 0.0
        a, b = random.randint(1, 50), random.randint(1, 50)
        assert R.math_compute_score("math", f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{2 * a}/{2 * b}")["acc"] == 1.0


def test_extract_final_answer():
    assert R.extract_final_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert R.extract_final_answer("#### 5\nmore text") == "5"
    assert R.extract_final_answer("\\boxed 5") == "5"
    assert R.extract_final_answer("no answer here") is None
    with pytest.raises(TypeError, match="solution_str"):
        R.extract_final_answer(5)


@pytest.mark.parametrize("response, truth, ok", [
    ("46", "46", True), (" 46\n", "46", True), ("-12", "-12", True), ("061", "061", True),
    ("046", "46", False), ("61", "061", False),
    ("45", "46", False), ("4 6", "46", False), ("46\n46", "46", False), ("", "46", False),
    ("forty-six", "46", False), ("46.0", "46", False),
], ids=lambda v: repr(v) if isinstance(v, str) else str(v))
def test_arithmetic_checker(response, truth, ok):
    out = R.arithmetic_compute_score("arithmetic", response, truth)
    assert out["acc"] == float(ok) and out["score"] == float(ok)


def test_arithmetic_checker_random():
    for _ in range(200):
        a, b = random.randint(0, 999), random.randint(0, 999)
        assert R.arithmetic_compute_score("arithmetic", str(a * b), str(a * b))["acc"] == 1.0
        assert R.arithmetic_compute_score("arithmetic", str(a * b + 1), str(a * b))["acc"] == 0.0


def test_default_dispatch():
    assert R.default_compute_score("arithmetic", "12", "12")["acc"] == 1.0
    # The demo checker wants the bare number; the math checker wants "#### x".
    assert R.default_compute_score("arithmetic", "#### 12", "12")["acc"] == 0.0
    for src in ("gsm8k", "openai/gsm8k", "lighteval/MATH", "math_dapo", "dapo_math", "aime24"):
        assert R.default_compute_score(src, "#### 12", "12")["acc"] == 1.0, src
    with pytest.raises(ValueError, match="data_source 'poetry'"):
        R.default_compute_score("poetry", "x", "y")
    with pytest.raises(TypeError, match="data_source"):
        R.default_compute_score(None, "x", "y")


@pytest.mark.parametrize("response, truth, acc", [
    ("Let me think.\nAnswer: 3", "3", 1.0),
    ("work\nanswer:  34\n", "34", 1.0),
    ("Answer: 3\nwait, no.\nAnswer: 5", "5", 1.0),
    ("so\nAnswer: $x = 12$", "12", 1.0),
    ("Answer: \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("Answer: 4", "3", 0.0),
    ("no final line, then \\boxed{7}", "7", 1.0),
], ids=["plain", "lowercase", "last-wins", "equation", "boxed-in-line", "wrong", "boxed-fallback"])
@pytest.mark.parametrize("source", ["math_dapo", "aime24", "aime25"])
def test_dapo_math_answer_line_format(source, response, truth, acc):
    """DAPO-Math-17k's "Answer: x" last line earns reward as verl's math_dapo scores it (its last
    "Answer:" first, else the last \\boxed{}); 0/1 here where verl gives +-1."""
    assert R.default_compute_score(source, response, truth) == {"score": acc, "acc": acc}


@pytest.mark.parametrize("truth", [3.0, 3, "3.0", "3"], ids=["float", "int", "float-text", "text"])
def test_arithmetic_float_ground_truth_is_its_integer(truth):
    """A float answer column's 3.0 (or its text "3.0") is the integer 3 to the demo checker, as to
    the math checker; "3.5" stays wrong for "3"."""
    assert R.default_compute_score("arithmetic", "3", truth)["acc"] == 1.0
    assert R.default_compute_score("math", "#### 3", truth)["acc"] == 1.0
    assert R.default_compute_score("arithmetic", "3", 3.5)["acc"] == 0.0
    assert R.answer_text(3.0) == "3" and R.answer_text(2.5) == "2.5" and R.answer_text(-7) == "-7"


def test_load_reward_fn(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str == ground_truth)\n"
        "def graded(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'coherence': 1.0, 'relevance': 0.0}\n"
        "NOT_CALLABLE = 3\n")
    fn = R.load_reward_fn(str(f), "compute_score")
    assert fn("x", "a", "a") == 1.0 and fn("x", "a", "b") == 0.0
    assert R.load_reward_fn(f, "graded")("x", "", "")["coherence"] == 1.0
    with pytest.raises(ValueError, match="custom_reward_function.name.*'missing'"):
        R.load_reward_fn(str(f), "missing")
    with pytest.raises(TypeError, match="custom_reward_function.name"):
        R.load_reward_fn(str(f), "NOT_CALLABLE")
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        R.load_reward_fn(str(tmp_path / "nope.py"), "compute_score")
