"""The package's layering, read from its imports (at the top of a module or inside a function alike): each layer
imports only the layers below it, the math core imports nothing else of atrctl, no modules import each other
in a circle, and the public paths that outlived the move into sub-packages still name the very same objects."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "atrctl"

# Bottom to top; a module may import its own layer and those below.  Names are atrctl's sub-packages and
# top-level modules; the public shims (atrctl.divergence, .losses, .passk, .advantages) sit with the core.
LAYERS = [
    {"core", "divergence", "losses", "passk", "advantages"},
    {"errors", "numbers"},
    {"files", "runtime"},
    {"tasks"},
    {"model"},
    {"config"},
    {"rollout"},
    {"training"},
    {"reports"},
    {"experiments"},
    {"integrations"},
    {"cli", "__main__"},
]


def atrctl_imports(path: Path) -> set[str]:
    """Every atrctl module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("atrctl")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("atrctl"):
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # a module or a name in one
    return found


def module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module(name: str) -> str:  # `from atrctl.x import y`: y may be a module or a name in x
        while name not in names and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    return {name: {module(i) for i in atrctl_imports(path)} - {name, "atrctl"} for name, path in names.items()}


def test_no_modules_import_each_other_in_a_circle():
    graph, circles = module_graph(), []
    for start in graph:  # a path from a module back to itself, found by depth-first search
        stack, seen = [(start, [start])], set()
        while stack:
            name, path = stack.pop()
            for after in graph.get(name, ()):
                if after == start:
                    circles.append(" -> ".join([*path, start]))
                elif after not in seen:
                    seen.add(after)
                    stack.append((after, [*path, after]))
    assert not circles, circles[:3]


def layer(module: str) -> int:
    """The layer of `atrctl.<part>...`; the package itself (its version) counts as the bottom."""
    part = module.split(".")[1] if "." in module else "core"
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_every_module_belongs_to_a_layer():
    placed = set().union(*LAYERS)
    unplaced = [name for name in module_graph() if "." in name and name.split(".")[1] not in placed]
    assert not unplaced, unplaced


def test_no_layer_imports_a_layer_above_it():
    upward = [f"{name} -> {imported}" for name, imports in module_graph().items()
              for imported in imports if layer(imported) > layer(name)]  # fmt: skip
    assert not upward, upward


@pytest.mark.parametrize("module", sorted(p.name for p in (PACKAGE / "core").glob("*.py")))
def test_the_math_core_imports_nothing_else_of_atrctl(module):
    outside = {name for name in atrctl_imports(PACKAGE / "core" / module) if not name.startswith("atrctl.core")}
    assert not outside, f"core/{module} imports {sorted(outside)}"


def test_the_checks_read_real_imports():  # not a graph of nothing, which would pass them all
    graph = module_graph()
    assert (
        "atrctl.core.divergence" in graph["atrctl.core.losses"]
        and "atrctl.core.losses" in graph["atrctl.training.step"]
    )
    assert (
        "atrctl.files.atomic" in graph["atrctl.training.rundir"] and "atrctl.cli.options" in graph["atrctl.cli.train"]
    )
    assert layer("atrctl.cli.train") > layer("atrctl.training.loop") > layer("atrctl.core.losses")


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
