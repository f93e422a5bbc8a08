"""`atrctl eval` end to end on a tiny run directory: its three files, refusals, one-line errors."""

import pandas as pd
import pytest
from helpers import DATA

from atrctl.cli import main
from atrctl.config.loading import load_recipe, recipe_to_dict, to_toml
from atrctl.model.loading import build_char_tokenizer, build_model

FAST = ["--n", "8", "--problems", "5", "--device", "cpu"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as training leaves it (config.toml and model/), with untrained tiny weights."""
    directory = tmp_path_factory.mktemp("runs") / "tiny-run"
    recipe = load_recipe(None, ["task.args.digits=1", "rollout.max_new_tokens=3", "model.device=cpu"])
    directory.mkdir()
    (directory / "config.toml").write_text(to_toml(recipe_to_dict(recipe)))
    tokenizer = build_char_tokenizer()
    build_model("tiny", tokenizer).save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    return directory


def test_eval_of_a_run_writes_its_three_files(run_dir, capsys):
    assert main(["eval", str(run_dir), *FAST]) == 0
    out = capsys.readouterr().out
    assert "pass@k" in out and "maj@k" in out and "passk.png" in out
    frame = pd.read_csv(run_dir / "eval" / "passk.csv")
    assert list(frame.columns) == ["k", "pass@k", "ci_low", "ci_high", "avg@k", "avg_low", "avg_high", "maj@k"]
    assert frame["k"].tolist() == [1, 2, 4, 8]
    assert ((frame["ci_low"] <= frame["pass@k"]) & (frame["pass@k"] <= frame["ci_high"])).all()
    assert ((frame["avg_low"] <= frame["avg@k"]) & (frame["avg@k"] <= frame["avg_high"])).all()
    assert frame["pass@k"].is_monotonic_increasing and frame["avg@k"].iloc[-1] == pytest.approx(frame["pass@k"].iloc[0])
    markdown = (run_dir / "eval" / "passk.md").read_text()
    for text in (
        "| k | pass@k | 95% CI | avg@k | 95% CI | maj@k |",
        "avg@n",
        "greedy accuracy",
        "n: 8",
        "problems: 5",
        "temperature: 1",
        "seed: 0",
        "seconds",
    ):
        assert text in markdown
    assert (run_dir / "eval" / "passk.png").read_bytes()[:4] == b"\x89PNG"

    before = (run_dir / "eval" / "passk.csv").read_text()
    assert main(["eval", str(run_dir), *FAST, "--k", "1,3"]) == 2  # an existing evaluation is kept
    assert "--overwrite" in capsys.readouterr().err
    assert (run_dir / "eval" / "passk.csv").read_text() == before
    assert main(["eval", str(run_dir), *FAST, "--k", "3,1", "--overwrite"]) == 0
    assert pd.read_csv(run_dir / "eval" / "passk.csv")["k"].tolist() == [1, 3]


def test_eval_of_a_model_directory_needs_a_task(run_dir, tmp_path):
    out = tmp_path / "model-eval"
    args = [
        "eval",
        str(run_dir / "model"),
        "--task",
        "arith",
        "--task-arg",
        "digits=1",
        "--max-new-tokens",
        "3",
        "--out",
        str(out),
        "--seed",
        "3",
        *FAST,
    ]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["passk.csv", "passk.md", "passk.png", "samples.jsonl"]
    assert "seed: 3" in (out / "passk.md").read_text()


def test_samples_jsonl_shows_each_problems_greedy_and_first_samples_as_scored(run_dir, tmp_path):
    import json

    from atrctl.tasks import get_task

    out = tmp_path / "shown"
    base = ["eval", str(run_dir), "--out", str(out), *FAST]
    assert main([*base, "--completions", "2"]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 5 * 3 and [r["sample"] for r in rows[:3]] == ["greedy", 0, 1]
    task = get_task("arith", digits=1)
    problems = {p.id: p for p in task.problems("test", None, 0)}
    for row in rows:  # each row's verdict is the task's verdict on the completion it shows
        assert row["reward"] == task.score(problems[row["problem"]], row["completion"]).reward
        assert row["prompt"] == problems[row["problem"]].prompt and row["gold"] == problems[row["problem"]].answer
    csv = pd.read_csv(out / "passk.csv")
    assert main([*base, "--completions", "all", "--overwrite"]) == 0  # every sample: 1 + 8 per problem
    assert len((out / "samples.jsonl").read_text().splitlines()) == 5 * 9
    assert pd.read_csv(out / "passk.csv").equals(csv)  # keeping texts changes no figure
    assert main([*base, "--completions", "some", "--overwrite"]) == 2


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--task", "nope"], "unknown task"),
        (["--k", "1,16"], "--k"),
        (["--n", "0"], "--n"),
        (["--k", "1,two"], "--k"),
        (["--k", "0"], "--k"),
        (["--temperature", "0"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--problems", "0"], "--problems"),
        (["--task-arg", "digits"], "--task-arg"),
        (["--task-arg", "digits=0"], "digits"),
        (["--split", "dev"], "split"),
        (["--device", "tpu"], "device"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(run_dir, tmp_path, capsys, extra, needle):
    out = tmp_path / "out"
    assert main(["eval", str(run_dir), *FAST, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("target", "extra", "needle"),
    [
        ("./no/such/model", ["--task", "arith", "--max-new-tokens", "3"], "not found"),
        ("{model}", ["--max-new-tokens", "3"], "--task"),
        ("{model}", ["--task", "arith"], "--max-new-tokens"),
    ],
)
def test_bad_targets_are_one_line(run_dir, tmp_path, capsys, target, extra, needle):
    out = tmp_path / "out"
    assert main(["eval", target.format(model=run_dir / "model"), *FAST, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err
    assert not out.exists()


def test_a_run_without_its_final_model_is_refused(tmp_path, capsys):
    (tmp_path / "config.toml").write_text(to_toml(recipe_to_dict(load_recipe(None, []))))
    assert main(["eval", str(tmp_path), *FAST]) == 2
    assert "no final model" in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()


def test_an_unwritable_output_folder_is_one_line(run_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["eval", str(run_dir), *FAST, "--out", str(tmp_path / "file" / "eval")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "is a file, not a folder" in err and "\n" not in err


CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny model whose tokenizer has a chat template, as the benchmarks' presets ask for one."""
    directory = tmp_path_factory.mktemp("chat-model")
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT
    build_model("tiny", tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_benchmark_is_evaluated_at_its_preset_unless_a_flag_says_otherwise(chat_model, tmp_path):
    """aime25's preset: every problem (two in the stand-in file), T 0.6, top-p 0.95, the chat template; the
    flags given (n, the token limit, the backend) override it."""
    out = tmp_path / "aime"
    stand_in = ["--task", "aime25", "--task-arg", f"path={DATA / 'aime_sample.jsonl'}", "--device", "cpu"]
    args = ["eval", str(chat_model), *stand_in, "--n", "4", "--max-new-tokens", "3", "--backend", "hf"]
    assert main([*args, "--out", str(out)]) == 0
    markdown = (out / "passk.md").read_text()
    assert "aime25 test, 2 problems, n=4, T=0.6, top-p=0.95, ≤3 new tokens, chat template" in markdown
    assert "hf backend" in markdown and pd.read_csv(out / "passk.csv")["k"].tolist() == [1, 2, 4]
    args += ["--temperature", "1", "--top-p", "1", "--no-chat-template", "--problems", "1"]
    assert main([*args, "--out", str(tmp_path / "given")]) == 0
    assert "1 problems, n=4, T=1, ≤3 new tokens, no chat template" in (tmp_path / "given" / "passk.md").read_text()


def test_preset_settings_fill_only_what_is_not_given(monkeypatch):
    import importlib.util

    from atrctl.experiments.evaluation import preset_settings

    given = dict(n=None, temperature=None, top_p=None, max_new_tokens=None, problems=None, chat_template=None,
                 backend=None)  # fmt: skip
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no vLLM here
    assert preset_settings("aime24", given, n=256) == dict(n=32, temperature=0.6, top_p=0.95, max_new_tokens=32768,
                                                           problems=None, chat_template=True, backend=None)  # fmt: skip
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # vLLM installed
    assert preset_settings("math500", given | {"n": 8})["backend"] == "vllm"
    assert preset_settings("math500", given | {"backend": "hf"})["backend"] == "hf"
    assert preset_settings("arith", given, n=256, temperature=1.0) == given | {"n": 256, "temperature": 1.0}
