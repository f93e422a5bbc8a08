"""`atrctl ls`: what recipes can name, from the registries themselves."""

from __future__ import annotations

from atrctl.cli.display import console


def list_registered() -> None:
    """List what recipes can name: losses (with parameters), trust regions, estimators, tasks, backends, recipes."""
    from atrctl.cli import tables
    from atrctl.reports.catalog import sections

    for section in sections():
        console.print(tables.catalog_table(section.title, section.columns, section.rows))
