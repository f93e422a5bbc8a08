"""Load a data set task's rows, from the Hugging Face hub or a local file, as train and test problems.

`path` is a hub name ("openai/gsm8k") or a local .json/.jsonl/.parquet file; `test_path` optionally names
a separate local test file. A source with a single split (one local file, or a hub set with one split) is
split by a stable hash of each row's first field, so the test rows never change with n or seed.
"""

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atrctl.errors import UserError, first_line
from atrctl.tasks.problem import SPLITS, Problem, check_format
from atrctl.tasks.split import split_of

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}

log = logging.getLogger(__name__)
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."  # Qwen2.5-Math's


def dataset_format(task: str, format: str) -> tuple[str, str]:
    """(instruction, what follows the question) of a data set task's format: compact is the question and a
    newline, for base models that continue in the data set's own style; instruct is the bare question with
    the boxed-answer instruction."""
    check_format(task, format)
    return (BOXED_INSTRUCTION, "") if format == "instruct" else ("", "\n")


def load_problems(
    task: str,
    path: str,
    config: str | None,
    test_path: str | None,
    fields: tuple[str, ...],
    to_problem: Callable[[dict], Problem | None],
) -> dict[str, list[Problem]]:
    """Problems per split; rows that to_problem cannot use (None) are skipped with a warning."""
    sources = _load(task, str(path), config, None if test_path is None else str(test_path))
    for source, dataset in sources:
        check_fields(task, source, dataset.column_names, fields)
    if len(sources) == 1:
        rows: dict[str, list[dict]] = {split: [] for split in SPLITS}
        for row in sources[0][1].to_list():
            rows[split_of(str(row[fields[0]]))].append(row)
    else:
        rows = {split: dataset.to_list() for split, (_, dataset) in zip(SPLITS, sources, strict=True)}
    problems = {split: [p for p in map(to_problem, rows[split]) if p is not None] for split in SPLITS}
    note_skipped(task, str(path), sum(map(len, problems.values())), sum(map(len, rows.values())))
    return problems


def load_benchmark(
    task: str,
    path: str,
    config: str | None,
    split: str,
    fields: tuple[str, ...],
    to_problem: Callable[[dict], Problem | None],
) -> list[Problem]:
    """Every usable row of a benchmark: a local file whole, or the hub set's `split` (a benchmark is its test
    set, never cut by a hash); rows without a usable reference answer are skipped with a warning."""
    if _is_local(path):
        source, dataset = path, load_local(task, path)
    else:
        splits = _load_hub(path, config)
        if split not in splits:
            raise UserError(f"hub data set {path!r} has no split {split!r} (it has {', '.join(splits)}); pass split=")
        source, dataset = f"{path} [{split}]", splits[split]
    return usable_rows(task, source, dataset.to_list(), dataset.column_names, fields, to_problem)


def usable_rows(
    task: str, source: str, rows: list[dict], columns: list[str], fields: tuple[str, ...], to_problem
) -> list[Problem]:
    """The problems of `rows` (a source's every row, with `columns`), its missing fields and unusable rows
    refused or noted as a data set task's are."""
    check_fields(task, source, columns, fields)
    problems = [p for p in map(to_problem, rows) if p is not None]
    note_skipped(task, source, len(problems), len(rows))
    return problems


def check_fields(task: str, source: str, columns: list[str], fields: tuple[str, ...]) -> None:
    """Refuse a source whose rows lack a field the task reads, naming what it has."""
    missing = [f for f in fields if f not in columns]
    if missing:
        raise UserError(
            f"{source} lacks field(s) {', '.join(missing)}; the {task} task expects rows with "
            f"{', '.join(fields)} (has: {', '.join(columns)})"
        )


def note_skipped(task: str, source: str, usable: int, total: int) -> None:
    """Refuse a source without one usable row; say how many rows were skipped where only some were."""
    if not usable:
        raise UserError(f"no usable {task} rows in {source}: none has a reference answer in the expected format")
    if usable < total:
        log.warning("note: skipped %d of %d %s rows without a usable reference answer", total - usable, total, task)


def _load(task: str, path: str, config: str | None, test_path: str | None) -> list[tuple[str, Any]]:
    """[(source, Dataset)]: one entry to be hash-split, or two for train and test."""
    if test_path is not None:
        return [(path, load_local(task, path)), (test_path, load_local(task, test_path))]
    if _is_local(path):
        return [(path, load_local(task, path))]
    splits = _load_hub(path, config)
    if all(split in splits for split in SPLITS):
        return [(f"{path} [{split}]", splits[split]) for split in SPLITS]
    if len(splits) == 1:
        ((name, dataset),) = splits.items()
        return [(f"{path} [{name}]", dataset)]
    raise UserError(f"hub data set {path!r} has splits {', '.join(splits)}, not train and test; pass local files")


def _is_local(path: str) -> bool:
    """A file path rather than a hub name: it exists, has a data file suffix, or starts with / or ."""
    return Path(path).exists() or Path(path).suffix.lower() in LOCAL_FORMATS or path.startswith(("/", "."))


def load_local(task: str, path: str):
    import datasets  # here, not at the top: it takes most of a second and only these tasks need it

    file = Path(path)
    kind = LOCAL_FORMATS.get(file.suffix.lower())
    if kind is None:
        raise UserError(f"{path} is not a .json, .jsonl or .parquet file; convert it or pass a hub data set name")
    if not file.is_file():
        raise UserError(f"data file {path} does not exist; check the path given to the {task} task")
    if kind == "json":  # the reader decodes lazily, so a bad byte would surface later as a traceback
        try:
            file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise UserError(f"{path} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    try:
        return datasets.load_dataset(kind, data_files=str(file), split="train")
    except Exception as err:  # the library's error types vary by format; the user needs the file named
        raise UserError(f"could not read {path} as {kind}: {first_line(err)}; fix or regenerate the file") from err


def _load_hub(name: str, config: str | None):
    import datasets

    try:
        return datasets.load_dataset(name, config)
    except Exception as err:  # offline, misspelled, gated: all end the same way for the user
        raise UserError(
            f"could not load {name!r} from the Hugging Face hub ({first_line(err)}); "
            "check the name and network, or pass an existing local .jsonl/.parquet file as path"
        ) from err
