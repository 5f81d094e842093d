"""The layout keeps its promises: no package cycles, no upward imports, one entry point per process, status writes
in one place, small modules and functions. Parsed from the source (ast), so a new violation fails here first."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from gyre_slurm.ledger.models import STATUS_COLUMNS

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "gyre_slurm"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# programs a harness worker runs in a workspace (the reference harness, the built-in evaluator): their own entry
PROGRAMS = {"gyre_slurm.harness.reference_agent", "gyre_slurm.scoring.builtin_eval", "gyre_slurm.harness.netrelay",
            "gyre_slurm.scoring.harbor_verify"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        name = ".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(f.read_text(), str(f))
    return out


MODULES = _modules()


def _unit(module: str) -> str:
    """The package a module belongs to (gyre_slurm.coordinator.loop → coordinator); top-level modules are their own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gyre_slurm"


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every gyre_slurm import, at any depth (lazy imports count)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("gyre_slurm")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gyre_slurm"):
            out.append((node.module, [a.name for a in node.names]))
    return out


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, tree in MODULES.items():
        for target, _names in _imports(tree):
            a, b = _unit(mod), _unit(target)
            if a != b and b != "gyre_slurm":
                edges[a].add(b)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = "open"
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == "open":
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []


def test_no_package_cycles() -> None:
    assert _cycles(_graph()) == [], "packages import each other in a cycle"


@pytest.mark.parametrize(("lower", "upper"), [
    ("model", "train"), ("harness", "scoring"), ("harness", "worker"), ("scoring", "worker"),
    ("ledger", "coordinator"), ("scheduler", "coordinator"), ("trajectory", "coordinator"),
    ("engines", "proxy"), ("engines", "agent"), ("protocol", "coordinator"),
])
def test_lower_layers_never_import_upper_ones(lower: str, upper: str) -> None:
    assert upper not in _graph().get(lower, set()), f"{lower} imports {upper}"


def test_the_daemon_never_builds_a_model() -> None:
    for mod, tree in MODULES.items():
        if _unit(mod) != "coordinator":
            continue
        for target, names in _imports(tree):
            assert not target.startswith(("gyre_slurm.model", "gyre_slurm.train.warmup")), (mod, target)
            assert "ensure_model" not in names, mod


def test_no_module_imports_another_modules_private_names() -> None:
    bad = [(mod, target, n) for mod, tree in MODULES.items() for target, names in _imports(tree)
           for n in names if n.startswith("_") and target != mod]
    assert bad == []


def test_one_entry_point_per_process() -> None:
    """Every process of a run is a `gyre` subcommand; only the programs a worker runs have their own main."""
    for mod, tree in MODULES.items():
        if mod in PROGRAMS or mod == "gyre_slurm.__main__":
            continue
        src = ast.unparse(tree)
        assert "argparse" not in src, f"{mod} parses its own arguments"
        assert "__name__ == '__main__'" not in src, f"{mod} is a second entry point"


def test_rundir_and_the_cli_start_without_sqlalchemy_or_torch() -> None:
    code = ("import sys, gyre_slurm.rundir, gyre_slurm.run_context, gyre_slurm.launch.plan, gyre_slurm.config, "
            "gyre_slurm.statuses; "
            "print(sorted(m for m in ('sqlalchemy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_status_columns_are_written_only_through_the_state_machines() -> None:
    """No insert/update of a governed table sets its status (or a cell's role) except LedgerWriter.transition."""
    governed = {table: column for table, column in STATUS_COLUMNS.values()}
    bad = []
    for mod, tree in MODULES.items():
        if mod == "gyre_slurm.ledger.store":
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("insert", "insert_ignore", "update") and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in governed):
                continue
            if any(k.arg == governed[node.args[0].value] for k in node.keywords):
                bad.append(f"{mod}:{node.lineno}")
    assert bad == []


def _long_functions(tree: ast.Module) -> list[tuple[str, int]]:
    funcs = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    return [(f.name, n) for f in funcs if (n := f.end_lineno - f.lineno + 1) > MAX_FUNCTION_LINES]


@pytest.mark.parametrize("folder", ["gyre_slurm", "tools", "tests"])
def test_small_modules_and_functions(folder: str) -> None:
    big, long = [], []
    for f in sorted((REPO / folder).rglob("*.py")):
        text = f.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append((str(f.relative_to(REPO)), len(text.splitlines())))
        long += [(str(f.relative_to(REPO)), *fn) for fn in _long_functions(ast.parse(text))]
    assert big == [], f"modules over {MAX_MODULE_LINES} lines"
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines"
