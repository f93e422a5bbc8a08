"""The package's layering, read from its imports: the math core imports nothing else of atrctl, and the public
paths that outlived the move into sub-packages still name the very same objects."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "atrctl"


def atrctl_imports(path: Path) -> set[str]:
    """Every atrctl module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("atrctl")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("atrctl"):
            found |= {f"{node.module}.{alias.name}" if node.module == "atrctl" else node.module for alias in node.names}
    return found


@pytest.mark.parametrize("module", sorted(p.name for p in (PACKAGE / "core").glob("*.py")))
def test_the_math_core_imports_nothing_else_of_atrctl(module):
    outside = {name for name in atrctl_imports(PACKAGE / "core" / module) if not name.startswith("atrctl.core")}
    assert not outside, f"core/{module} imports {sorted(outside)}"


def test_the_core_layer_is_seen_by_the_check():  # the check above reads real imports, not nothing
    assert "atrctl.core.divergence" in atrctl_imports(PACKAGE / "core" / "losses.py")
    assert "atrctl.core.losses" in atrctl_imports(PACKAGE / "train.py")


@pytest.mark.parametrize(
    "public, names",
    [
        ("divergence", ["TRUST_REGIONS", "trust_region", "kl3_bounds", "equivalent_clip"]),
        ("losses", ["POLICY_LOSSES", "policy_loss", "register_policy_loss", "token_losses"]),
        ("passk", ["EvalResult", "pass_at_k"]),
        ("advantages", ["ADVANTAGE_ESTIMATORS", "group_advantages"]),
    ],
)
def test_public_paths_name_the_core_objects(public, names):
    import importlib

    shown, real = importlib.import_module(f"atrctl.{public}"), importlib.import_module(f"atrctl.core.{public}")
    for name in names:
        assert getattr(shown, name) is getattr(real, name), name
