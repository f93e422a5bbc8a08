"""GSM8K: grade-school word problems whose answer is the number after "####" in the worked solution."""

from atrctl.tasks.answer import Found, answer_number, find_answer, plain
from atrctl.tasks.data import dataset_format, load_problems
from atrctl.tasks.mathcheck import extract, matches
from atrctl.tasks.problem import Problem, Score, check_request
from atrctl.tasks.split import stable_hash, take

FIELDS = ("question", "answer")
MAX_ANSWER_CHARS = 200  # bounds the sympy work on a boxed answer that is not a plain number


class GSM8KTask:
    """path: hub name or local .json/.jsonl/.parquet with question/answer rows; config: hub config;
    test_path: optional separate local test file (else one file is split 90/10 by a hash of the question);
    format: compact (the question and a newline, for base models that continue in GSM8K's own style) or
    instruct (the question, and an instruction to box the answer).

    A completion's answer is found by `atrctl.tasks.answer` (last \\boxed{}, "####", "answer is", the last
    line) and compared with math-verify.
    """

    name = "gsm8k"

    def __init__(
        self,
        path: str = "openai/gsm8k",
        config: str | None = "main",
        test_path: str | None = None,
        format: str = "compact",
    ):
        self.format = format
        self.instruction, suffix = dataset_format(self.name, format)
        self._problems = load_problems(self.name, path, config, test_path, FIELDS, lambda row: _problem(row, suffix))

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        check_request(split, n)
        return take(self._problems[split], n, seed, f"gsm8k {split} problems")

    def score(self, problem: Problem, completion: str) -> Score:
        found = find_answer(completion)
        parsed = answer_number(found)
        if parsed is not None:
            return Score(float(matches(problem.answer, extract(f"\\boxed{{{parsed}}}"))), parsed)
        if found is not None and found.rule != "last-line" and len(found.text) <= MAX_ANSWER_CHARS:
            prediction = extract(f"\\boxed{{{plain(found.text)}}}")  # \\frac{9}{2}, 9/2: math-verify reads them
            if prediction:
                return Score(float(matches(problem.answer, prediction)), str(prediction[-1]))
        return Score(0.0, None)


def _problem(row: dict, suffix: str) -> Problem | None:
    question, worked = str(row["question"]), str(row["answer"])
    answer = answer_number(Found(worked.rpartition("####")[2], "hashes")) if "####" in worked else None
    if answer is None:
        return None
    return Problem(id=f"gsm8k-{stable_hash(question):016x}", prompt=question + suffix, answer=answer, solution=worked)
