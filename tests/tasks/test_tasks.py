"""Tasks: deterministic disjoint splits, correct rewards, a verifier that resists hostile text, clear errors."""

import builtins
import json
import string
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import DATA

from atrctl.errors import UserError
from atrctl.tasks import TASKS, Problem, get_task
from atrctl.tasks.answer import answer_number, find_answer, last_boxed

ALPHABET = set(string.digits + "+-*/()=<>.,:;?! " + string.ascii_lowercase + "\n")


def _procedural():
    return [get_task("arith"), get_task("arith", digits=1, ops="+-*"), get_task("countdown", count=4)]


def _datasets():
    return [
        get_task("gsm8k", path=str(DATA / "gsm8k_sample.jsonl")),
        get_task("math", path=str(DATA / "math_sample.jsonl")),
        get_task("math", path=str(DATA / "math_sample.parquet")),
    ]


@pytest.fixture(scope="module")
def all_tasks():
    return _procedural() + _datasets()


def test_registry_names():
    assert {"arith", "countdown", "gsm8k", "math"} <= set(TASKS)  # the shipped tasks; a new one needs no edit here


def test_same_seed_same_problems_and_seeds_differ(all_tasks):
    for task in all_tasks:
        n = 5 if task.name in ("arith", "countdown") else None
        assert task.problems("train", n, seed=3) == task.problems("train", n, seed=3)
        assert task.problems("train", n, seed=3) != task.problems("train", n, seed=4)


def test_train_and_test_are_disjoint(all_tasks):
    for task in all_tasks:
        n = 200 if task.name in ("arith", "countdown") else None
        train, test = task.problems("train", n, 0), task.problems("test", None if n is None else 20, 0)
        assert train and test
        assert not {p.id for p in train} & {p.id for p in test}
        assert not {p.prompt for p in train} & {p.prompt for p in test}


def test_problems_within_a_call_are_distinct(all_tasks):
    for task in all_tasks[:3]:
        ids = [p.id for p in task.problems("train", 250, 1)]
        assert len(set(ids)) == len(ids)


def test_procedural_text_uses_only_the_char_alphabet():
    for task in _procedural():
        for p in task.problems("train", 100, 0):
            assert set(p.prompt + p.answer + p.solution) <= ALPHABET, p


def test_arith_format_and_scoring():
    task = get_task("arith", digits=3, ops="+-*")
    problems = task.problems("train", 300, 0)
    assert all(len(p.prompt) == 8 and p.prompt.endswith("=") for p in problems)
    assert {p.prompt[3] for p in problems} == {"+", "-", "*"}
    p = Problem(id="x", prompt="407+058=", answer="465", solution="465")
    assert task.score(p, "465").reward == 1.0
    assert task.score(p, "465\n7+1=8").reward == 1.0
    assert task.score(p, " 0465").parsed == "465"
    assert task.score(p, "466") == task.score(p, "466")
    assert task.score(p, "466").reward == 0.0 and task.score(p, "466").parsed == "466"
    assert task.score(p, "x465").parsed is None and task.score(p, "").reward == 0.0
    assert task.score(p, "9" * 1_000_000).parsed is None
    neg = Problem(id="y", prompt="003-010=", answer="-7", solution="-7")
    assert task.score(neg, "-7").reward == 1.0 and task.score(neg, "7").reward == 0.0
    for p in problems:
        assert task.score(p, p.solution).reward == 1.0


def test_arith_small_space_lists_all_and_refuses_too_many():
    task = get_task("arith", digits=1)
    train, test = task.problems("train", None, 0), task.problems("test", None, 0)
    assert len(train) + len(test) == 100
    with pytest.raises(UserError, match="lower n"):
        task.problems("test", len(test) + 1, 0)
    with pytest.raises(UserError, match="pass n"):
        get_task("arith", digits=3).problems("train", None, 0)


def test_countdown_solutions_verify():
    for task in (get_task("countdown"), get_task("countdown", count=4, max_number=50, max_target=500)):
        for split in ("train", "test"):
            for p in task.problems(split, 100, 7):
                assert task.score(p, p.solution).reward == 1.0, p
                assert p.prompt.endswith(f">{p.answer}:")


COUNTDOWN = Problem(id="c", prompt="2,3,7,7>14:", answer="14", solution="7+7")


@pytest.mark.parametrize(
    "completion",
    ["7+7", "7*2", "(7-3)/2*7", " 2 * 7 ", "7+7\nwhatever follows", "((7+7))", "(3-2)*(7+7)", "(7+7)/(3-2)"],
)
def test_countdown_accepts_correct_expressions(completion):
    score = get_task("countdown").score(COUNTDOWN, completion)
    assert score.reward == 1.0 and score.parsed == "14"


def _nested(depth):
    return "(" * depth + "7" + ")" * depth + "+7"


HOSTILE = [
    "7*2*1",  # 1 is not given
    "7+7+7",  # 7 used three times
    "2*2*3",  # 2 used twice
    "14",  # a number not given
    "7+3",  # valid but wrong value
    "7/2",
    "7 7",
    "7+",
    "",
    "-7+21",
    "2^3+7-1",
    "__import__('os').system('x')",
    "9**9**9",
    "7**7**7**7",
    "1/0",
    "7/(3-3)",
    "7" * 1_000_000,
    "(" * 1_000_000,
    "7+" * 500_000 + "7",
    _nested(30),
    "\n7+7",
    "7+7.0",
    "seven plus seven",
]


def test_countdown_rejects_hostile_and_wrong_text(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("model output reached eval/exec/compile")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    task = get_task("countdown")
    for completion in HOSTILE:
        assert task.score(COUNTDOWN, completion).reward == 0.0, completion[:40]
    assert task.score(COUNTDOWN, "7+3").parsed == "10"
    assert task.score(COUNTDOWN, "7/2").parsed == "7/2"
    assert task.score(COUNTDOWN, "1/0").parsed is None
    assert task.score(COUNTDOWN, "7*2*1").parsed is None
    assert task.score(COUNTDOWN, _nested(7)).reward == 1.0


def test_gsm8k_fixture_loads_and_scores():
    task = get_task("gsm8k", path=str(DATA / "gsm8k_sample.jsonl"))
    problems = task.problems("train", None, 0) + task.problems("test", None, 0)
    assert len(problems) == 10
    for p in problems:
        assert p.prompt.endswith("?\n") and p.solution.endswith(f"#### {p.answer}")
        assert task.score(p, p.solution).reward == 1.0
    p = next(p for p in problems if p.answer == "420")
    assert task.score(p, "The tank keeps 420 liters.").reward == 1.0
    assert task.score(p, "#### 420.00\nI also tried 7").reward == 1.0
    assert task.score(p, "so 1500-1080 = 421 liters").reward == 0.0
    assert task.score(p, "no idea") == task.score(p, "no idea") and task.score(p, "no idea").parsed is None


def test_gsm8k_answer_parsing():
    def number(text):
        return answer_number(find_answer(text))

    assert number("first 3, then 5\n#### 1,234\nlater 9") == "1234"  # "####" outranks a later number
    assert number("costs $18.50 then 7.0") == "7"  # the last line's last number, normalized
    assert number("#### $-12") == "-12"
    assert number("nothing here") is None


def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{\sqrt{2}}{2}} done") == r"\frac{\sqrt{2}}{2}"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize("file", ["math_sample.jsonl", "math_sample.parquet"])
def test_math_fixture_loads_and_scores(file):
    task = get_task("math", path=str(DATA / file))
    problems = {p.answer: p for p in task.problems("train", None, 0) + task.problems("test", None, 0)}
    assert len(problems) == 7  # eight rows, two share the answer 9
    for p in problems.values():
        assert task.score(p, p.solution).reward == 1.0
    half = problems[r"\frac{1}{2}"]
    assert task.score(half, r"so the answer is \boxed{0.5}.").reward == 1.0
    assert task.score(half, "The answer is 1/2").reward == 1.0
    assert task.score(half, r"\boxed{\frac{1}{3}}").reward == 0.0
    assert task.score(half, r"\boxed{}").parsed is None
    assert task.score(problems[r"5\sqrt{2}"], r"\boxed{\sqrt{50}}").reward == 1.0
    assert task.score(half, "x" * 1_000_000).reward == 0.0


def test_separate_test_file(tmp_path):
    rows = [json.loads(line) for line in (DATA / "gsm8k_sample.jsonl").read_text().splitlines()]
    for name, part in (("train.jsonl", rows[:7]), ("test.jsonl", rows[7:])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    task = get_task("gsm8k", path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "test.jsonl"))
    assert len(task.problems("train", None, 0)) == 7 and len(task.problems("test", None, 0)) == 3


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(UserError, match=r"did you mean 'countdown'.*arith, countdown, gsm8k, math"):
        get_task("countdwn")


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("arith", {"digit": 2}, "no parameter digit; valid parameters: digits, ops"),
        ("arith", {"digits": 0}, "digits=0 is invalid"),
        ("arith", {"ops": "+/"}, "ops='\\+/' is invalid"),
        ("countdown", {"count": "3"}, "count='3' is invalid"),
        ("gsm8k", {"path": "no/such/file.jsonl"}, "data file no/such/file.jsonl does not exist"),
        ("math", {"path": str(DATA / "malformed_sample.jsonl")}, "lacks field\\(s\\) problem, solution"),
        ("gsm8k", {"path": str(DATA / "malformed_sample.jsonl")}, "expects rows with question, answer"),
        ("gsm8k", {"path": str(DATA / "data.csv")}, "data.csv is not a .json, .jsonl or .parquet file"),
    ],
)
def test_bad_parameters_raise_user_error(name, params, message):
    with pytest.raises(UserError, match=message):
        get_task(name, **params)


def test_hub_failure_is_a_user_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        UserError, match=r"could not load 'nobody/no-such-set' from the Hugging Face hub \(Couldn't"
    ) as err:
        get_task("gsm8k", path="nobody/no-such-set")
    assert "\n" not in str(err.value)


def test_math_scoring_works_off_the_main_thread():
    """math-verify's signal-based timeout would raise in a worker thread; the task must not use it there."""
    task = get_task("math", path=str(DATA / "math_sample.jsonl"))
    problems = task.problems("train", None, 0)
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda p: task.score(p, p.solution), problems))
    assert [s.reward for s in scores] == [1.0] * len(problems)


def test_rows_without_a_reference_answer_are_skipped(tmp_path):
    rows = [{"question": "How many?", "answer": "Some.\n#### many"}, {"question": "And now?", "answer": "#### 4"}]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get_task("gsm8k", path=str(tmp_path / "g.jsonl"))
    problems = task.problems("train", None, 0) + task.problems("test", None, 0)
    assert [p.answer for p in problems] == ["4"]
    (tmp_path / "g.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(UserError, match="no usable gsm8k rows"):
        get_task("gsm8k", path=str(tmp_path / "g.jsonl"))


def test_bad_requests_raise_user_error():
    task = get_task("arith")
    with pytest.raises(UserError, match="use 'train' or 'test'"):
        task.problems("validation", 5, 0)
    with pytest.raises(UserError, match="non-negative integer"):
        task.problems("train", -1, 0)
    with pytest.raises(UserError, match="lower n or raise the limits"):
        get_task("countdown", count=2, max_number=2).problems("train", 50, 0)


def test_a_countdown_split_is_all_of_it_once_exhausted():
    """A trainer's pool asks for more problems than a small countdown holds: it gets the whole split (n = None),
    of which any smaller request is the start, and every problem is distinct and of its split."""
    from atrctl.tasks import problem_pool
    from atrctl.tasks.split import split_of

    task = get_task("countdown", count=2, max_number=6)
    everything = task.problems("train", None, 0)
    assert 0 < len(everything) < 200 and problem_pool(task, "train", 10_000, 0) == everything
    assert task.problems("train", 20, 0) == everything[:20]
    assert len({p.prompt for p in everything}) == len(everything) and {split_of(p.prompt) for p in everything} == {
        "train"
    }
    assert all(task.score(p, p.solution).reward == 1 for p in everything)


def test_verifiers_read_ascii_digits_only():
    """Other scripts' digits (Arabic-Indic ٣, fullwidth ３) are not numbers in these tasks' answers."""
    arith = get_task("arith")
    problem = arith.problems("test", 1, 0)[0]
    answer = problem.answer
    assert arith.score(problem, answer).reward == 1
    for digits in ("٠١٢٣٤٥٦٧٨٩", "０１２３４５６７８９"):
        foreign = "".join(digits[int(c)] if c.isdigit() else c for c in answer)
        assert arith.score(problem, foreign).reward == 0 and arith.score(problem, foreign).parsed is None
    countdown = get_task("countdown")
    problem = countdown.problems("test", 1, 0)[0]
    assert countdown.score(problem, problem.solution).reward == 1
    foreign = "".join("٠١٢٣٤٥٦٧٨٩"[int(c)] if c.isdigit() else c for c in problem.solution)
    assert countdown.score(problem, foreign).reward == 0


VERDICTS = json.loads((DATA / "verdicts.json").read_text())
DATA_PATHS = {
    "gsm8k": DATA / "gsm8k_sample.jsonl",
    "math": DATA / "math_sample.jsonl",
    "math500": DATA / "math500_sample.jsonl",
    "gsm8k-test": DATA / "gsm8k_sample.jsonl",
}  # the AIME tasks read the copy sgl-eval ships


@pytest.mark.parametrize("row", VERDICTS, ids=[f"{r['task']}-{i}" for i, r in enumerate(VERDICTS)])
def test_verifiers_agree_with_a_careful_reader_on_realistic_completions(row):
    """tests/data/verdicts.json: completions in the styles instruct models write (and the compact outputs of
    the character models), each with the verdict a careful human gives."""
    args = {"format": row["format"]} | ({"path": str(DATA_PATHS[row["task"]])} if row["task"] in DATA_PATHS else {})
    task = get_task(row["task"], **args)
    key = row["prompt"].rstrip(":") or "x"
    problem = Problem(id=f"{row['task']}-{key}", prompt=row["prompt"], answer=row["answer"], solution="")
    assert task.score(problem, row["completion"]).reward == float(row["correct"]), row["note"]


def test_the_verdict_table_covers_every_task_in_both_formats():
    assert len(VERDICTS) >= 60
    assert {r["task"] for r in VERDICTS} == set(TASKS)
    formats = {(r["task"], r["format"]) for r in VERDICTS}
    assert formats >= {("arith", "compact"), ("arith", "instruct"), ("countdown", "compact"), ("countdown", "instruct")}
    assert sum(not r["correct"] for r in VERDICTS) >= 20  # wrong answers, not only right ones
