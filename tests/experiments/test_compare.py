"""`atrctl compare`: arms, the two-level bootstrap table, and a small end-to-end comparison."""

import importlib.util
import json

import numpy as np
import pytest
from helpers import COMPARE, DATA, compare_args, offline_runs

from atrctl.cli import main
from atrctl.config.loading import load_recipe
from atrctl.core.passk import EvalResult
from atrctl.errors import UserError
from atrctl.experiments.compare import Arm, parse_arms
from atrctl.experiments.compare_report import comparison_table, interval, table_markdown, two_level_bootstrap


def result(correct_per_problem, n, greedy, seed=0):
    """An EvalResult whose problem p has correct_per_problem[p] of n samples right."""
    rewards = np.zeros((len(correct_per_problem), n), dtype=np.float32)
    for p, c in enumerate(correct_per_problem):
        rewards[p, :c] = 1.0
    parsed = [[None] * n for _ in correct_per_problem]
    ids = [f"p{i}" for i in range(len(correct_per_problem))]
    return EvalResult(ids, n, rewards, parsed, np.array(greedy, dtype=bool), 1.0, seed, 0.0)


def test_parse_arms():
    assert parse_arms(["grpo", "atr"]) == [Arm("grpo", "grpo"), Arm("atr", "atr")]
    with pytest.raises(UserError, match="unknown arm 'ppo'"):
        parse_arms(["grpo", "ppo"])
    with pytest.raises(UserError, match="must differ"):
        parse_arms(["atr", "atr"])


def test_table_values_and_differences():
    rng = np.random.default_rng(0)
    problems = 300
    weak = [result(rng.binomial(4, 0.2, problems), 4, rng.random(problems) < 0.2, s) for s in range(3)]
    strong = [result(rng.binomial(4, 0.7, problems), 4, rng.random(problems) < 0.7, s) for s in range(3)]
    rows = comparison_table({"weak": weak, "strong": strong, "twin": weak}, [1, 4])
    assert [row["row"] for row in rows] == ["weak", "strong", "twin", "strong − weak", "twin − weak"]
    weak_mean = np.mean([r.correct / 4 for r in weak])
    assert rows[0]["pass@1"] == pytest.approx(weak_mean)
    assert rows[0]["pass@1 low"] < rows[0]["pass@1"] < rows[0]["pass@1 high"]
    assert rows[3]["pass@1"] == pytest.approx(rows[1]["pass@1"] - rows[0]["pass@1"])
    assert rows[3]["pass@1 excludes_0"] and rows[3]["greedy excludes_0"]
    assert not rows[4]["pass@1 excludes_0"] and rows[4]["pass@1"] == 0.0  # the same runs: no difference
    markdown = table_markdown(rows, ["pass@1", "pass@4", "greedy"])
    assert "| strong − weak | 3 |" in markdown and "★" in markdown.splitlines()[5]


def test_two_level_bootstrap_covers_seed_noise():
    problems = np.tile(np.linspace(0, 1, 50), (4, 1))
    steady = problems.copy()
    shaky = problems + np.array([[-0.2], [0.2], [-0.2], [0.2]])  # same mean, seeds disagree
    boot = two_level_bootstrap([steady, shaky], resamples=500, seed=1)
    width = [np.subtract(*reversed(interval(boot[:, i]))) for i in range(2)]
    assert width[1] > width[0]
    assert np.array_equal(boot, two_level_bootstrap([steady, shaky], resamples=500, seed=1))


@pytest.mark.slow
def test_small_comparison_writes_every_file_and_resumes(tmp_path, capsys, monkeypatch, request):
    monkeypatch.setenv("ATRCTL_PROGRESS_SECONDS", "0")  # every update, as plain lines: stdout is not a terminal
    wandb = importlib.util.find_spec("wandb") is not None  # the dev extra has it: its runs are checked here too
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(compare_args(tmp_path, *(["--report-to", "wandb"] if wandb else []))) == 0
    directory = tmp_path / "compare-grpo-atr"
    out = capsys.readouterr().out
    assert (
        "\x1b" not in out and out.count("train 2 runs  4/4") == 1 and "eval grpo-s0  40/40" in out
    )  # completions: 8 greedy, 8 × 4 sampled
    for run in ("grpo", "atr"):  # the training children write theirs to their logs
        log = (directory / "runs" / f"{run}-s0.log").read_text()
        assert "\x1b" not in log and f"train {run}  2/2  reward " in log
    for name in ("passk.md", "passk.csv", "passk.png", "training.csv", "training.png", "mechanism.csv", "bounds.png",
                 "report.md", "compare.json"):  # fmt: skip
        assert (directory / name).stat().st_size > 0, name
    for run in ("grpo-s0", "atr-s0"):
        summary = json.loads((directory / "runs" / run / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["algo"] == run.split("-")[0]
        assert (directory / "runs" / run / "eval" / "passk.csv").is_file()
    recipes = {arm: (directory / "recipes" / f"{arm}.toml").read_text() for arm in ("grpo", "atr")}
    assert recipes["grpo"].replace('loss = "grpo"', 'loss = "atr"') == recipes["atr"]  # only the loss differs
    report = (directory / "report.md").read_text()
    assert "atrctl compare grpo atr" in report and "| atr − grpo | 1 |" in report
    assert "problem noise only" in report  # one seed: the report says what its intervals cover
    assert "| arm | seeds | final entropy | clip/low | clip/high | kl3/mean | ratio range | bad steps |" in report
    assert (
        "| arm | p_old | Δ log p, A>0 | Δ log p, A<0 | clip/high | clip/low |" in report and "| atr | ≥0.9 |" in report
    )
    assert "atr − grpo" in out
    if wandb:  # each run's W&B run is grouped under the comparison and gets its evaluation
        for arm in ("grpo", "atr"):
            run = directory / "runs" / f"{arm}-s0"
            training, evaluation = offline_runs(run)[:2]  # the rerun below reports its evaluation again
            assert training["group"] == evaluation["group"] == "compare-grpo-atr"
            assert training["name"] == f"{arm}-s0" and training["id"] == evaluation["id"]
            assert any("evaluation/passk/nrows" in row for row in evaluation["history"])
            pass_at_1 = float((run / "eval" / "passk.csv").read_text().splitlines()[1].split(",")[1])
            assert evaluation["summary"]["evaluation/pass@1"] == pytest.approx(pass_at_1)

    finished = {run: (directory / "runs" / run / "summary.json").stat().st_mtime_ns for run in ("grpo-s0", "atr-s0")}
    from functools import partial

    from atrctl.tasks import PRESETS, TASKS, Preset

    # AIME's prompts run past the tiny model's 512 positions: the stand-in file's two short ones, at a tiny preset
    monkeypatch.setitem(TASKS, "aime25", partial(TASKS["aime25"], path=str(DATA / "aime_sample.jsonl")))
    monkeypatch.setitem(PRESETS, "aime25", Preset(n=2, temperature=0.6, top_p=0.95, max_new_tokens=3))
    from atrctl.training.checks import _longest_preset_prompt  # its cache would keep the stand-in's prompts

    request.addfinalizer(_longest_preset_prompt.cache_clear)
    benchmark = ["--set", 'eval.benchmarks=["aime25"]']
    assert main(compare_args(tmp_path, *benchmark)) == 0  # again, without --report-to, with a benchmark: runs
    assert {run: (directory / "runs" / run / "summary.json").stat().st_mtime_ns for run in finished} == finished
    report = (directory / "report.md").read_text()  # are reused, not retrained, and evaluated on it
    assert "### aime25: 2 problems, n = 2, T = 0.6, top-p 0.95, ≤3 new tokens" in report
    assert "| arm | seeds | pass@1 | pass@2 | greedy | entropy |" in report.split("## Benchmarks")[1]
    rows = (directory / "benchmarks.csv").read_text().splitlines()
    assert rows[0].startswith("benchmark,row,seeds,pass@1") and [r.split(",")[:2] for r in rows[1:]] == [
        ["aime25", "grpo"], ["aime25", "atr"], ["aime25", "atr − grpo"]]  # fmt: skip
    for run in finished:
        setting = (directory / "runs" / run / "eval-aime25" / "passk.md").read_text().splitlines()[0]
        assert setting == f"# {run}: aime25"

    assert main(compare_args(tmp_path, "--max-kl3", "0.05")) == 2  # a different comparison under the same name
    assert "holds a compare with another shared recipe" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--n", "0"], "--n must be at least 1"),
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--max-kl3", "-1"], "max_kl3"),
        (["--set", 'eval.benchmarks=["aime25"]'], "the longest prompt (1555 tokens) plus aime25's max new tokens"),
        (["--set", 'eval.benchmarks=["aime"]'], "eval.benchmarks: 'aime' is not a benchmark; use one of aime24"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, extra, message):
    assert main(compare_args(tmp_path, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "compare-grpo-atr").exists()


def test_unknown_arm_is_one_line(tmp_path, capsys):
    assert main(["compare", "grpo", "ppo", "--results", str(tmp_path)]) == 2
    assert "unknown arm 'ppo'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_shared_flags_become_the_parameters_of_the_trust_regions_that_take_them(tmp_path):
    from atrctl.experiments.compare import plan_comparison

    comparison = plan_comparison(
        ["grpo", "dapo", "atr", "gspo"], seeds=1, n=4, problems=8, jobs=1, recipe=load_recipe(None, COMPARE),
        max_kl3=0.05, eps=0.1, eps_high=0.3, name=None, overwrite=False, results=tmp_path,
    )  # fmt: skip
    expected = {"grpo": {"eps": 0.1}, "dapo": {"eps_low": 0.1, "eps_high": 0.3}, "atr": {"max_kl3": 0.05}}
    assert comparison.loss_args == expected  # gspo keeps its own, sequence-level ε
    assert comparison.record()["loss_args"] == expected and list(tmp_path.iterdir()) == []  # planning writes nothing


@pytest.mark.slow
def test_the_pipeline_runs_from_python_without_the_cli(tmp_path):
    from atrctl.experiments.compare import plan_comparison, run_comparison

    recipe = load_recipe(None, [*COMPARE, "run.steps=1"])
    comparison = plan_comparison(
        ["grpo", "atr"], seeds=1, n=2, problems=4, jobs=2, recipe=recipe, max_kl3=None, eps=None, eps_high=None,
        name="py", overwrite=False, results=tmp_path,
    )  # fmt: skip
    shown = []
    rows, ks = run_comparison(comparison, n=2, problems=4, jobs=2, results=tmp_path, command="from python",
                              advance=lambda key, *progress: shown.append(key))  # fmt: skip
    assert ks == [1, 2] and [row["row"] for row in rows] == ["grpo", "atr", "atr − grpo"]
    assert {"warmup", "train", "eval grpo-s0", "eval atr-s0"} <= set(shown)
    assert "from python" in (tmp_path / "compare-py" / "report.md").read_text()


def test_mechanism_summary_divides_summed_shares_over_every_step_and_seed(tmp_path):
    from atrctl.experiments.compare_report import mechanism_summary

    steps = [
        {"step": 1, "clip/low/p00-10": 0.02, "tokens/neg/p00-10": 0.10, "dlogp/neg/p00-10": -0.5},
        {"step": 2, "clip/low/p00-10": 0.00, "tokens/neg/p00-10": 0.10},  # its cell held no dlogp
    ]
    other_seed = [{"step": 1, "clip/low/p00-10": 0.06, "tokens/neg/p00-10": 0.20, "dlogp/neg/p00-10": -0.2}]
    directories = []
    for name, records in (("s0", steps), ("s1", other_seed)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        directories.append(tmp_path / name)
    summary = mechanism_summary(directories)
    assert summary["clip/low/{bin}"][0] == pytest.approx(0.08 / 0.40)  # of the A<0 tokens at p_old < 0.1
    assert summary["dlogp/neg/{bin}"][0] == pytest.approx(-0.35)  # over the steps that measured it
    assert np.isnan(summary["clip/high/{bin}"][0]) and np.isnan(summary["dlogp/pos/{bin}"][3])
    (tmp_path / "gspo").mkdir()  # gspo clips sequences: it logs token shares but no binned clip, which is not 0
    (tmp_path / "gspo" / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens/neg/p00-10": 0.3}) + "\n")
    assert np.isnan(mechanism_summary([tmp_path / "gspo"])["clip/low/{bin}"][0])


def test_the_training_table_gives_each_arms_mean_and_seed_range(tmp_path):
    """Final entropy over the last SMOOTHING steps, the other figures over all steps, then mean [min, max] over
    seeds; a figure no step logged is a dash."""
    from atrctl.experiments.compare_report import training_markdown, training_rows
    from atrctl.reports.curves import SMOOTHING

    def run(name, clip_low, entropy):
        directory = tmp_path / name
        directory.mkdir()
        records = [{"step": i + 1, "entropy": entropy if i >= 2 else 9.0, "clip/low": clip_low, "clip/high": 0.0,
                    "kl3/mean": 0.01, "ratio/min": 0.5, "ratio/max": 2.0, "skipped_steps": int(i >= 2 and name == "a1")}
                   for i in range(SMOOTHING + 2)]  # fmt: skip
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return directory

    rows = training_rows({"a": [run("a0", 0.1, 1.0), run("a1", 0.3, 2.0)], "b": [run("b0", 0.2, 1.5)]})
    seed_range = (rows[0]["clip/low low"], rows[0]["clip/low high"])
    assert rows[0]["clip/low"] == pytest.approx(0.2) and seed_range == pytest.approx((0.1, 0.3))
    assert rows[0]["final entropy"] == pytest.approx(1.5)  # the first two steps' 9.0 are not in the last SMOOTHING
    table = training_markdown(rows)
    assert "| a | 2 | 1.500 [1.000, 2.000] | 0.200 [0.100, 0.300] | 0.000 [0.000, 0.000] |" in table
    assert "| b | 1 |" in table and "0.500–2.000" in table
    assert rows[0]["bad steps high"] == 1 and table.count(" | 0.500–2.000 | 1 |") == 1  # a1's one, the last count
    assert " | 0.500–2.000 | 0 |" in table  # b had none


def test_the_mechanism_table_gives_each_arms_seed_mean_and_range_per_bin(tmp_path):
    """Δ log p per p_old bin: each seed's mean over its steps, then mean [lowest, highest] over the seeds; a
    cell no seed measured is a dash."""
    from atrctl.experiments.compare_report import mechanism_markdown, mechanism_rows

    def run(name, moves):
        directory = tmp_path / name
        directory.mkdir()
        records = [{"step": i + 1, "dlogp/pos/p90-100": move, "tokens/pos/p90-100": 0.5, "clip/high/p90-100": 0.1}
                   for i, move in enumerate(moves)]  # fmt: skip
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return directory

    rows = mechanism_rows({"a": [run("a0", [0.1, 0.3]), run("a1", [0.4])]})
    assert [row["p_old"] for row in rows] == ["p<0.1", "0.1–0.5", "0.5–0.9", "≥0.9"]
    sure = rows[3]
    assert sure["dlogp/pos/{bin}"] == pytest.approx(0.3) and sure["dlogp/pos/{bin} low"] == pytest.approx(0.2)
    assert sure["dlogp/pos/{bin} high"] == pytest.approx(0.4) and sure["clip/high/{bin}"] == pytest.approx(0.2)
    table = mechanism_markdown(rows)
    assert "| a | ≥0.9 | 0.300 [0.200, 0.400] | — | 0.200 [0.200, 0.200] | — |" in table
    assert "| a | p<0.1 | — | — | — | — |" in table
