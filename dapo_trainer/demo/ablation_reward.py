"""The checker of the ablation's task family (:mod:`dapo_trainer.demo.ablation`), a file of
its own with no package imports: the trainer loads ``custom_reward_function.path`` by file."""
from typing import Optional


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> dict:
    """The family's checker: the digits sorted ascending, optionally after the input digits and
    ":" (the verbose convention). ``data_source == "sort_rare"`` also gives 0.5 for the
    descending order (a valid answer, worth less); ``acc`` counts ascending only."""
    text = solution_str.strip()
    head, sep, answer = text.rpartition(":")
    prompt = (extra_info or {}).get("prompt", "")
    if sep and head != prompt[len("sort:"):-1]:  # shown work must be the input digits
        return {"score": 0.0, "acc": 0.0}
    if answer == ground_truth:
        return {"score": 1.0, "acc": 1.0}
    if data_source == "sort_rare" and len(set(answer)) > 1 and answer == ground_truth[::-1]:
        return {"score": 0.5, "acc": 0.0}
    return {"score": 0.0, "acc": 0.0}
