"""Where a run's numbers go besides metrics.jsonl: TensorBoard and Weights & Biases (`run.report_to`).

A reporter gets the resolved recipe when the run starts, every step's record, the completions of each
held-out check, and the evaluation tables at the end; metrics.jsonl stays the record every atrctl
command reads, so a tracker is only ever a view.  Each reporter's library is imported only when the
recipe asks for it, and checked before anything is written: a missing one is one line naming the
install.  Only rank 0 reports.

Weights & Biases: the run's id is kept in <run>/wandb/id, so a resumed run (or a later evaluation)
continues the same W&B run; the x axis of every chart is atrctl's own `step` (records logged again
after a resume land on the steps they belong to).  A run in a comparison or sweep
(<comparison>/runs/<arm>-s<seed>) is grouped under the comparison's name.  WANDB_PROJECT (default
"atrctl"), WANDB_ENTITY and WANDB_MODE (e.g. offline) are W&B's own settings.  Everything W&B writes stays in
<run>/wandb/: its service's logs (WANDB_CACHE_DIR) and the staging copies of logged tables (WANDB_DATA_DIR)
too, which would otherwise pile up in ~/.cache/wandb and ~/.local/share/wandb; an offline run keeps its
copies there for `wandb sync`, an online one has them removed once uploaded.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from atrctl.errors import UserError, first_line

if TYPE_CHECKING:
    from atrctl.config.schema import RunConfig

INSTALL = {
    "tensorboard": 'pip install tensorboard (or -e ".[tensorboard]")',
    "wandb": 'pip install wandb (or -e ".[wandb]")',
}
START_HELP = {
    "tensorboard": "check that the run directory is writable",
    "wandb": "log in (`wandb login`, or WANDB_API_KEY), or set WANDB_MODE=offline to keep the run local",
}
SAMPLE_COLUMNS = ("problem", "sample", "prompt", "completion", "answer", "gold", "reward")


def reporter_names(run: RunConfig) -> list[str]:
    """The trackers a recipe's [run] asks for: report_to, plus TensorBoard for the tensorboard shorthand."""
    return list(dict.fromkeys([*run.report_to, *(["tensorboard"] if run.tensorboard else [])]))


def check_installed(names: Sequence[str], run_path: Path | None = None) -> None:
    """Each tracker's library imports, and the W&B id a run at `run_path` kept reads; else one line saying
    what to do (checked before anything is written)."""
    for name in names:
        try:
            __import__(LIBRARIES[name])  # through the import statement's own hook
        except ImportError:
            raise UserError(f"run.report_to = {name} needs the {name} package: {INSTALL[name]}") from None
    if "wandb" in names and run_path is not None:
        kept_run_id(Path(run_path))


def kept_run_id(run_path: Path) -> str | None:
    """The W&B run id kept in <run>/wandb/id (None before the run's first report); a file that holds no id is
    a UserError naming it."""
    id_file = run_path / "wandb" / "id"
    if not id_file.is_file():
        return None
    run_id = id_file.read_text(errors="replace").strip()
    if not (run_id.isascii() and run_id.isalnum()):  # ours are 8 hex digits
        raise UserError(f"{id_file} is not a W&B run id ({run_id[:40]!r}): restore it, or delete it to report "
                        "this run to a new W&B run")  # fmt: skip
    return run_id


def comparison_group(run_path: Path) -> str | None:
    """The comparison or sweep a run belongs to (<comparison>/runs/<run>, beside its compare.json or
    sweep.json), else None."""
    run_path = Path(run_path).resolve()
    comparison = run_path.parent.parent
    markers = (comparison / "compare.json", comparison / "sweep.json")
    return comparison.name if run_path.parent.name == "runs" and any(m.is_file() for m in markers) else None


class Reporters:
    """The run's trackers, fed together; an empty list of names makes every call a no-op."""

    def __init__(self, names: Sequence[str], run_path: Path, recipe: dict, resumed_at: int | None = None):
        """`resumed_at`: the step a resumed run's checkpoint holds; what a tracker got after it (logged before
        a crash, then trimmed from metrics.jsonl) is overwritten by the steps logged again."""
        made = []
        try:
            for name in names:
                try:
                    made.append(REPORTERS[name](run_path, recipe, resumed_at))
                except UserError:
                    raise
                except Exception as error:  # a tracker that cannot start (no login, no network) is bad input
                    why = first_line(error)
                    raise UserError(f"{name} reporting could not start ({why}); {START_HELP[name]}") from None
        except BaseException:
            for reporter in made:
                reporter.close(failed=True)
            raise
        self.reporters = made

    def log(self, record: dict) -> None:
        for reporter in self.reporters:
            reporter.log(record)

    def samples(self, step: int, rows: list[dict]) -> None:
        for reporter in self.reporters:
            reporter.samples(step, rows)

    def tables(self, tables: dict[str, tuple[Sequence[str], list[list]]], summary: dict[str, float]) -> None:
        """Tables (name → (columns, rows)) and headline figures at the end of a run or of its evaluation."""
        for reporter in self.reporters:
            reporter.tables(tables, summary)

    def close(self, failed: bool = False) -> None:
        for reporter in self.reporters:
            reporter.close(failed)


class TensorBoard:
    """Event files in <run>/tensorboard/: scalars per step, the recipe and the tables as text."""

    def __init__(self, run_path: Path, recipe: dict, resumed_at: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        from atrctl.config.loading import to_toml
        from atrctl.training.rundir import RunDir

        purge = None if resumed_at is None else resumed_at + 1  # events after the checkpoint are logged again
        self.writer = SummaryWriter(str(RunDir(run_path).tensorboard), purge_step=purge)
        self.step = resumed_at or 0
        self.writer.add_text("recipe", "```toml\n" + to_toml(recipe) + "```", 0)

    def log(self, record: dict) -> None:
        self.step = record["step"]
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(key, value, record["step"])

    def samples(self, step: int, rows: list[dict]) -> None:
        table = "\n".join(f"- **{r['problem']}** ({r['sample']}, reward {r['reward']:g}): `{r['completion']!r}`"
                          for r in rows)  # fmt: skip
        self.writer.add_text("samples", table, step)

    def tables(self, tables: dict, summary: dict[str, float]) -> None:
        for name, (columns, rows) in tables.items():
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join("" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for v in row)
                      + " |" for row in rows]  # fmt: skip
            self.writer.add_text(name, "\n".join(lines), self.step)
        for key, value in summary.items():
            self.writer.add_scalar(f"summary/{key}", value, self.step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class Wandb:
    """A W&B run per atrctl run, continued on resume (its id in <run>/wandb/id)."""

    def __init__(self, run_path: Path, recipe: dict, resumed_at: int | None = None):
        import wandb

        run_path = Path(run_path)
        self.directories = wandb_directories(run_path)
        self.previous = {name: os.environ.get(name) for name in self.directories}
        os.environ.update({name: str(path) for name, path in self.directories.items()})  # read by W&B as it runs
        try:
            self._start(wandb, run_path, recipe)
        except BaseException:
            self._restore()
            raise
        self.step = resumed_at or 0

    def _start(self, wandb, run_path: Path, recipe: dict) -> None:
        run_id = kept_run_id(run_path)
        if run_id is None:
            from atrctl.files import atomic

            run_id = secrets.token_hex(4)
            (run_path / "wandb").mkdir(parents=True, exist_ok=True)
            atomic.write_text(run_path / "wandb" / "id", run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "atrctl"),
            id=run_id,
            name=run_path.name,
            group=comparison_group(run_path),
            dir=str(run_path),
            config=recipe,
            resume="allow",
            settings=wandb.Settings(console="off", silent=True),  # atrctl's own output stays as it is
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # the charts' x axis: atrctl's step

    def log(self, record: dict) -> None:
        # W&B's own step too, so that sessions line up when a resumed run is synced; steps logged again after
        # a resume (the crash came after the checkpoint) hold the values the lost session logged: resume is exact
        self.step = record["step"]
        self.run.log(record, step=record["step"])

    def samples(self, step: int, rows: list[dict]) -> None:
        import wandb

        data = [[row.get(c) if c == "reward" else str(row.get(c, "")) for c in SAMPLE_COLUMNS] for row in rows]
        table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=data, allow_mixed_types=True)
        self.run.log({"samples": table, "step": step}, step=max(step, self.step))

    def tables(self, tables: dict, summary: dict[str, float]) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=list(columns), data=rows, allow_mixed_types=True)
                      for name, (columns, rows) in tables.items()}, step=self.step)  # fmt: skip
        self.run.summary.update(summary)

    def close(self, failed: bool = False) -> None:
        """Finish the W&B run and stop W&B's service (it logs to the run's cache folder while it lives)."""
        import wandb

        try:
            offline = self.run.offline
            self.run.finish(exit_code=1 if failed else 0)
            wandb.teardown()
            if not offline:  # uploaded: the staging copies are of no further use
                shutil.rmtree(self.directories["WANDB_DATA_DIR"] / "artifacts" / "staging", ignore_errors=True)
        finally:
            self._restore()

    def _restore(self) -> None:
        for name, value in self.previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def wandb_directories(run_path: Path) -> dict[str, Path]:
    """The folders W&B writes besides its run (--dir), as the variables that name them, all in <run>/wandb/;
    one the user set explicitly is kept."""
    chosen = {"WANDB_CACHE_DIR": run_path / "wandb" / "cache", "WANDB_DATA_DIR": run_path / "wandb" / "data"}
    return {name: Path(os.environ.get(name) or path).absolute() for name, path in chosen.items()}


REPORTERS = {"tensorboard": TensorBoard, "wandb": Wandb}
"""Tracker name → its reporter: a class (run_path, recipe dict, resumed_at) with log(record), samples(step,
rows), tables(tables, summary) and close(failed), importing its library only when made."""
LIBRARIES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}
"""What each tracker imports: checked before a run writes anything."""


def held_out_table(summary: dict) -> tuple[dict, dict[str, float]]:
    """A finished run's held-out figures, base and final, as a table and as headline figures."""
    base, final = summary.get("base") or {}, summary.get("final") or {}
    keys = sorted(set(base) | set(final))
    rows = [[key, base.get(key), final.get(key)] for key in keys]
    headline = {f"final/{key}": value for key, value in final.items()} | {f"base/{key}": v for key, v in base.items()}
    return {"held-out": (["metric", "base", "final"], rows)}, headline


def report_evaluation(run_path: Path, passk_csv: Path) -> None:
    """Send a run's finished evaluation (its passk.csv) to the trackers its recipe names: the same W&B run
    its training reported to, continued."""
    import csv

    from atrctl.training.rundir import RunDir

    recipe = RunDir(run_path).recipe()
    names = reporter_names(recipe.run)
    if not names:
        return
    with open(passk_csv, newline="") as handle:
        rows = list(csv.reader(handle))
    columns, data = rows[0], [[_number(v) for v in row] for row in rows[1:]]
    # "evaluation/…", not "eval/…": the held-out checks during training log eval/pass@1 already
    headline = {f"evaluation/pass@{int(row[0])}": row[1] for row in data if isinstance(row[1], float)}
    from atrctl.config.loading import recipe_to_dict

    last = max((record["step"] for record in RunDir(run_path).read_metrics()), default=0)
    try:  # the tables go one step after training's last, where a resumed W&B run still takes rows
        reporters = Reporters(names, run_path, recipe_to_dict(recipe), resumed_at=last + 1)
    except UserError as error:
        raise UserError(f"{error} (the evaluation itself is written: {passk_csv.parent})") from None
    try:
        reporters.tables({"evaluation/passk": (columns, data)}, headline)
    finally:
        reporters.close()


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text
