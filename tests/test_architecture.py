"""The layout keeps its promises: no package cycles, no upward imports, one entry point per process, status writes
in one place, small modules and functions. Parsed from the source (ast), so a new violation fails here first."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from gyre_slurm.ledger.models import STATUS_COLUMNS, Base

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "gyre_slurm"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# programs a harness worker runs in a workspace (the reference harness, the built-in evaluator): their own entry
PROGRAMS = {"gyre_slurm.harness.reference_agent", "gyre_slurm.scoring.builtin_eval", "gyre_slurm.harness.netrelay",
            "gyre_slurm.scoring.harbor_verify", "gyre_slurm.harness.jail"}


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
    ("engines", "proxy"), ("engines", "agent"), ("protocol", "coordinator"), ("train", "harness"), ("train", "proxy"),
])
def test_lower_layers_never_import_upper_ones(lower: str, upper: str) -> None:
    assert upper not in _graph().get(lower, set()), f"{lower} imports {upper}"


def test_the_daemon_never_builds_a_model() -> None:
    for mod, tree in MODULES.items():
        if _unit(mod) != "coordinator":
            continue
        for target, names in _imports(tree):
            assert not target.startswith(("gyre_slurm.model", "gyre_slurm.bootstrap")), (mod, target)
            assert "ensure_model" not in names, mod


def test_only_launchers_and_the_reference_weights_reach_the_bootstrap() -> None:
    """bootstrap/ sits above harness/, proxy/, train/ and model/: nothing it builds on may come back to it."""
    users = {u for u, targets in _graph().items() if "bootstrap" in targets}
    assert users <= {"cli", "launch", "agent"}, users


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


SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\b.*\b(FROM|INTO|SET|WHERE)\b", re.IGNORECASE | re.DOTALL)
RAW_WRITES_AND_READS = {"insert", "insert_ignore", "update", "set", "rows", "scalar"}


def _text(node: ast.AST) -> str | None:
    """A string constant's text, an f-string's literal parts joined ({} for each value), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _on_ledger(func: ast.Attribute) -> bool:
    """`ledger.x(...)` or `self.ledger.x(...)`."""
    recv = func.value
    return (isinstance(recv, ast.Name) and recv.id == "ledger") or (isinstance(recv, ast.Attribute)
                                                                    and recv.attr == "ledger")


def _sql_spoken(tree: ast.Module) -> list[str]:
    """SQL in a module: a string that reads as SQL, or the ledger's raw insert/update/set/rows/scalar called
    (through the daemon's ledger, or anywhere with a table's name)."""
    out = []
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # read with the f-string
    for node in ast.walk(tree):
        s = _text(node)
        if s is not None and id(node) not in parts and SQL.search(s):
            out.append(f"{node.lineno}: SQL {s[:60]!r}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in RAW_WRITES_AND_READS:
            first = _text(node.args[0]) if node.args else None
            if _on_ledger(node.func) or (first is not None and (first in Base.metadata.tables or SQL.search(first))):
                out.append(f"{node.lineno}: {ast.unparse(node.func)}({first!r}, …)")
    return out


def _a_string(value: ast.expr) -> bool:
    """A string constant, or a conditional that may give one."""
    if isinstance(value, ast.IfExp):
        return _a_string(value.body) or _a_string(value.orelse)
    return isinstance(value, ast.Constant | ast.JoinedStr) and _text(value) is not None


def _string_severities(tree: ast.Module) -> list[str]:
    """`.event(…, severity=…)` calls whose severity is spelled as a string rather than a Severity member."""
    return [f"{node.lineno}: {ast.unparse(node)[:80]}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "event"
            for k in node.keywords if k.arg == "severity" and _a_string(k.value)]


def test_the_coordinator_speaks_no_sql_and_events_take_a_severity() -> None:
    """The coordinator reads and writes the ledger through its typed API (ledger/reads.py, ledger/records.py): no SQL
    string, no raw insert/update/rows/scalar by table name; every event's severity is a Severity member."""
    planted = ast.parse('def f(self, rid, x):\n'
                        '    self.ledger.update("rollouts", {"id": rid}, cell_id=1)\n'
                        '    n = self.ledger.scalar("SELECT max(id) FROM groups") or 0\n'
                        '    q = f"select id from rollouts where id = {rid}"\n'
                        '    w.insert_ignore("tasks", id=1)\n'
                        '    self.ledger.event("k", "m", severity="warning" if x else "info")\n')
    assert len(_sql_spoken(planted)) == 5 and len(_string_severities(planted)) == 1
    bad = [f"{mod}:{line}" for mod, tree in MODULES.items() if _unit(mod) == "coordinator"
           for line in _sql_spoken(tree)]
    assert bad == [], "SQL in the coordinator: give the ledger's API a named method instead"
    trees = [*MODULES.items(), *((f.stem, ast.parse(f.read_text())) for f in sorted((REPO / "tools").glob("*.py")))]
    assert [f"{mod}:{line}" for mod, tree in trees for line in _string_severities(tree)] == []
