"""Every timing tool in benchmarks/ still runs: its --smoke mode (a batch of seconds, figures meaningless), run from
the repository root as the tools document, exits cleanly and prints its table.  GPU-only paths (gpu_check.sh) are
exercised on a GPU machine."""

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import REPO

BENCHMARKS = REPO / "benchmarks"
TOOLS = {  # tool: a line its output holds when it measured something
    "vs_trl": "steps/s",
    "step_throughput": "steps/s",
    "scaling": "tiny",
    "shapes": "| tiny-smoke |",
    "profile_step": "Self CPU",
    "shard_memory": "| lora | rank 0 |",
    "shard_check": "tokens/s",
    "backends": "vllm / hf per pair",
}
NEEDS_VLLM = {"backends"}


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(set(TOOLS) - NEEDS_VLLM))
def test_each_tool_runs_its_smoke_mode(tool):
    if tool == "vs_trl" and importlib.util.find_spec("trl") is None:
        pytest.skip("vs_trl needs trl (the bench extra)")
    smoke(tool)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("tool", sorted(NEEDS_VLLM))
def test_each_vllm_tool_runs_its_smoke_mode(tool):
    pytest.importorskip("vllm")
    smoke(tool)


def smoke(tool: str) -> None:
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{tool}.py"), "--smoke"], capture_output=True,
                          text=True, cwd=BENCHMARKS.parent, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert TOOLS[tool] in done.stdout, done.stdout[-3000:]


def test_every_tool_is_listed_in_the_benchmarks_readme():
    listed = (BENCHMARKS / "README.md").read_text()
    tools = {path.stem for path in BENCHMARKS.glob("*.py")} - {"common"}
    assert tools == set(TOOLS) and all(f"benchmarks/{tool}.py" in listed for tool in tools)
