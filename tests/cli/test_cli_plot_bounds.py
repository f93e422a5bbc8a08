"""`atrctl plot-bounds` end to end, the CLI skeleton, and one-line errors for bad input."""

import csv
import math
import subprocess
import sys

import pytest

from atrctl import __version__
from atrctl.cli import main


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_writes_figure_and_csv(tmp_path, capsys):
    out = tmp_path / "fig.png"
    assert main(["plot-bounds", "--max-kl3", "0.1", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    rows = read_csv(tmp_path / "fig.csv")
    methods = [(r["method"], r["setting"]) for r in rows if r["table"] == "methods"]
    assert methods == [
        ("grpo", "eps=0.2"),
        ("dapo", "eps_low=0.2, eps_high=0.28"),
        ("atr", "max_kl3=0.1"),
        ("kl2", "delta=0.1"),
        ("reverse-kl3", "delta=0.1"),
    ]
    atr = next(r for r in rows if r["method"] == "atr")
    assert (round(float(atr["low"]), 6), round(float(atr["high"]), 6)) == (0.616817, 1.516221)
    sweep = [float(r["setting"].split("=")[1]) for r in rows if r["table"] == "sweep"]
    assert sweep == [0.005, 0.01, 0.02, 0.05, 0.1, 0.2]
    family = {r["method"]: (float(r["low"]), float(r["high"]), r["verl"]) for r in rows if r["table"] == "family"}
    assert list(family) == ["cispo", "gmpo", "clip-cov", "gppo", "two-sided", "opsm"]  # the others have none
    assert family["gmpo"][:2] == pytest.approx((math.exp(-0.4), math.exp(0.4)), abs=1e-12)
    assert family["gppo"] == (0.8, 1.28, "atrctl export gppo --to verl")  # not a plain clip range: its own loss
    printed = capsys.readouterr().out
    assert "0.616817" in printed and "1.516221" in printed and "[l, u]" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.csv", "fig.png"]  # no temp files left


def test_default_path_and_several_levels(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plot-bounds", "--max-kl3", "0.1", "--max-kl3", "0.05", "--format", "svg"]) == 0
    figure = tmp_path / "results/bounds/bounds-kl3-0.05_0.1.svg"
    assert figure.read_text().lstrip().startswith("<?xml")
    rows = read_csv(figure.with_suffix(".csv"))
    assert [r["setting"] for r in rows if r["table"] == "methods" and r["method"] == "atr"] == [
        "max_kl3=0.1",
        "max_kl3=0.05",
    ]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--max-kl3", "0"], "--max-kl3"),
        (["--max-kl3", "-0.1"], "--max-kl3"),
        (["--max-kl3", "nan"], "--max-kl3"),
        (["--max-kl3", "inf"], "--max-kl3"),
        (["--max-kl3", "abc"], "--max-kl3"),
        (["--max-kl3", "1000"], "--max-kl3"),
        (["--eps", "1"], "--eps"),
        (["--eps", "1.5"], "--eps"),
        (["--eps", "0"], "--eps"),
        (["--eps", "-0.2"], "--eps"),
        (["--eps-high", "0"], "--eps-high"),
        (["--format", "gif"], "--format"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, flag):
    out = tmp_path / "out" / "fig.png"
    assert main(["plot-bounds", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and flag in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    assert main(["plot-bounds", "--out", str(blocker / "fig.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "\n" not in err
    assert blocker.read_text() == "keep me"
    assert main(["plot-bounds", "--out", str(tmp_path / "fig.txt")]) == 2
    assert main(["plot-bounds", "--out", str(tmp_path / "fig.png"), "--format", "pdf"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_help_lists_commands_and_version(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in ("train", "eval", "compare", "plot-bounds"):
        assert command in text
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"atrctl {__version__}"


@pytest.mark.slow
def test_help_and_plot_bounds_do_not_import_heavy_libraries(tmp_path):
    code = (
        "import sys; from atrctl.cli import main; "
        f"main(['plot-bounds', '--out', r'{tmp_path / 'f.png'}']); "
        "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-300:] + result.stderr[-300:]
