"""The files of one evaluation: passk.csv, passk.md, passk.png and samples.jsonl (docs/design.md §5, <run>/eval/)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure  # a bare Figure needs no GUI backend and no global pyplot state

from atrctl.core.passk import EvalResult, avg_at_n
from atrctl.errors import UserError
from atrctl.files import atomic
from atrctl.reports.curves import arm_colours

COLUMNS = ("k", "pass@k", "ci_low", "ci_high", "avg@k", "avg_low", "avg_high", "maj@k")
Curve = tuple[str, Sequence[int], Sequence[float], Sequence[float], Sequence[float]]  # label, ks, mean, low, high


def passk_frame(result: EvalResult, ks: Sequence[int]) -> pd.DataFrame:
    """One row per k: pass@k and avg@k, each with its 95% bootstrap interval over problems, and maj@k."""
    summary = result.summary(ks)
    rows = [
        (k, *(summary[f"{metric}@{k}{part}"] for metric in ("pass", "avg") for part in ("", "/low", "/high")),
         summary[f"maj@{k}"])
        for k in ks
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))


def passk_markdown(result: EvalResult, frame: pd.DataFrame, title: str) -> str:
    """The table plus the settings that produced it, readable as it is and rendered on GitHub."""
    lines = [f"# {title}", "", "| k | pass@k | 95% CI | avg@k | 95% CI | maj@k |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [
        f"| {int(k)} | {mean:.4f} | [{low:.4f}, {high:.4f}] | {avg:.4f} | [{avg_low:.4f}, {avg_high:.4f}] "
        f"| {majority:.4f} |"
        for k, mean, low, high, avg, avg_low, avg_high, majority in frame[list(COLUMNS)].itertuples(
            index=False, name=None
        )
    ]
    lines += [
        "",
        f"- avg@n: {avg_at_n(result.rewards):.4f} (avg@k: the mean correctness of each problem's first k samples)",
        f"- greedy accuracy: {float(result.greedy.mean()):.4f}",
        *exploration_lines(result),
        f"- n: {result.n} samples per problem",
        f"- problems: {len(result.problem_ids)}",
        f"- temperature: {result.temperature:g}",
        f"- seed: {result.seed}",
        f"- seconds: {result.seconds:.1f}",
        "",
    ]
    return "\n".join(lines)


def exploration_lines(result: EvalResult) -> list[str]:
    """What the samples say about exploration beyond pass@k, where it was measured."""
    lines = []
    if (entropy := result.entropy()) is not None:
        lines.append(f"- entropy of the samples: {entropy.mean():.4f} nats per token (mean surprisal at T)")
    if (distinct := result.distinct_correct()) is not None:
        lines.append(f"- distinct correct answers per problem: {distinct.mean():.3f} of n = {result.n} samples")
    return lines


RESULT_ARRAYS, RESULT_RECORD = "result.npz", "result.json"


def save_result(directory: Path, key: dict, result: EvalResult) -> None:
    """Keep an evaluation's every sample outcome beside its figures, under the `key` of what produced it, so
    that the same evaluation of the same model is read back instead of sampled again (`load_result`).  The
    arrays carry the key's digest too: a crash between the two writes cannot pair one key with other data."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"rewards": result.rewards, "greedy": result.greedy, "digest": np.array(digest)}
    if result.nats is not None and result.lengths is not None:
        arrays.update(nats=result.nats, lengths=result.lengths)
    with atomic.atomic_path(directory / RESULT_ARRAYS) as tmp, open(tmp, "wb") as file:
        np.savez_compressed(file, **arrays)
    record = {"key": key, "digest": digest, "problem_ids": result.problem_ids, "n": result.n,
              "temperature": result.temperature, "seed": result.seed, "seconds": result.seconds,
              "parsed": result.parsed, "forms": result.forms, "completions": result.completions}  # fmt: skip
    atomic.write_text(directory / RESULT_RECORD, json.dumps(record) + "\n")


def load_result(directory: Path, key: dict) -> EvalResult | None:
    """The evaluation `save_result` kept under exactly this `key`; None where none is kept, or one of another
    key (or arrays a crash left from another key: their digest differs).  A kept file that is damaged is
    `DamagedFile` (the caller evaluates again and says so); a directory where a file belongs is refused, as
    the new result could not be written there either."""
    import json
    import zipfile

    from atrctl.files.records import NUMBER, DamagedFile, read_json

    paths = (directory / RESULT_RECORD, directory / RESULT_ARRAYS)
    for path in paths:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise UserError(f"{path} is not a file, so atrctl's evaluation cannot be kept there: remove it and rerun")
    if not any(path.exists() for path in paths):
        return None
    fix = "evaluating again"
    shape = {"key": dict, "digest": str, "problem_ids": list, "n": int, "temperature": NUMBER, "seed": int,
             "seconds": NUMBER, "parsed": list, "completions": list}  # fmt: skip
    record = read_json(paths[0], fix, shape)
    if record["key"] != json.loads(json.dumps(key)):
        return None
    try:
        with np.load(paths[1], allow_pickle=False) as arrays:
            data = {name: arrays[name] for name in arrays.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        raise DamagedFile(paths[1], type(error).__name__, fix) from None
    if "digest" not in data or str(data["digest"]) != record["digest"]:
        return None
    problems, n = len(record["problem_ids"]), record["n"]
    expected = {"rewards": (problems, n), "greedy": (problems,), "nats": (problems, n), "lengths": (problems, n)}
    for name, shape_of in expected.items():
        if (name in data or name in ("rewards", "greedy")) and getattr(data.get(name), "shape", None) != shape_of:
            raise DamagedFile(paths[1], f"'{name}' is not {problems} problems x {n} samples", fix)
    forms = record.get("forms")
    if not _rows_of(record["parsed"], problems, n) or (forms is not None and not _rows_of(forms, problems, n)):
        raise DamagedFile(paths[0], f"the parsed answers are not {problems} problems x {n} samples", fix)
    return EvalResult(
        record["problem_ids"], n, data["rewards"], record["parsed"], data["greedy"], record["temperature"],
        record["seed"], record["seconds"], record["completions"], data.get("nats"), data.get("lengths"), forms,
    )  # fmt: skip


def _rows_of(rows: object, problems: int, n: int) -> bool:
    return isinstance(rows, list) and len(rows) == problems and all(isinstance(r, list) and len(r) == n for r in rows)


def plot_passk_curves(curves: Sequence[Curve], title: str) -> Figure:
    """pass@k against k on a log2 axis, one line with its interval band per (label, ks, mean, low, high)."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ticks: set[int] = set()
    for colour, (label, ks, mean, low, high) in zip(arm_colours(len(curves)), curves, strict=True):
        ax.plot(ks, mean, marker="o", ms=4, lw=2, label=label, color=colour)
        ax.fill_between(ks, low, high, color=colour, alpha=0.2, lw=0)
        ticks.update(int(k) for k in ks)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [str(k) for k in sorted(ticks)])
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set(xlabel="k (samples per problem, log₂ scale)", ylabel="pass@k", title=title)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def write_eval(result: EvalResult, ks: Sequence[int], directory: Path, title: str) -> list[Path]:
    """Write passk.csv, passk.md, passk.png and samples.jsonl (the completions kept) atomically into
    directory; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    samples_path = directory / "samples.jsonl"
    atomic.write_jsonl(samples_path, result.completions)
    frame = passk_frame(result, ks)
    csv_path, md_path, png_path = (directory / f"passk.{ext}" for ext in ("csv", "md", "png"))
    atomic.write_text(md_path, passk_markdown(result, frame, title))
    label = f"pass@k (n={result.n}, T={result.temperature:g}), 95% CI"
    figure = plot_passk_curves([(label, ks, frame["pass@k"], frame["ci_low"], frame["ci_high"])], title)
    greedy = float(np.mean(result.greedy))
    figure.axes[0].axhline(greedy, color="0.4", ls="--", lw=1, label=f"greedy accuracy {greedy:.3f}")
    figure.axes[0].legend(loc="lower right", fontsize=8)
    with atomic.atomic_path(png_path) as tmp:
        figure.savefig(tmp, format="png", dpi=130)
    atomic.write_text(csv_path, frame.to_csv(index=False, float_format="%.6f"))  # last: rundir.has_evaluation
    return [csv_path, md_path, png_path, samples_path]
