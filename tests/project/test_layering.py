"""The import rules of docs/architecture.md ("Package imports"), enforced on the source: every
``import`` and ``from ... import`` of the four top-level packages, function-local ones included
(parsed with ast, nothing imported).

  * layers (``LAYERS``, bottom to top): a module imports only from its own layer and the layers
    below it, module-level and function-local imports alike;
  * no import cycles between modules: not at module level, and not through function-local
    imports either (a local import that closes a cycle only hides it), except ``HIDDEN_CYCLES``;
  * solver/ and runtime/ import nothing from autopar/ or codegen/ (they are usable on their own:
    the ILP without torch, the runtime ops without the planner);
  * no private name (``_x``) is imported from another package (directory): what crosses a
    package boundary is public.

``python tests/project/test_layering.py`` prints the numbers: modules, imports, function-local imports,
cross-layer edges, cycles (strongly connected components).
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("autopar", "solver", "codegen", "runtime")

# Bottom to top. A unit is a top-level package (runtime, solver, codegen), a sub-package of
# autopar (autopar.rules) or a module directly in autopar/ (autopar.cluster); "autopar" is
# autopar/__init__.py. Every unit must be listed: a new one has to be placed.
LAYERS = (
    ("runtime", ("runtime",)),            # the ops generated programs call; no planner
    ("solver", ("solver",)),              # the ILP, numpy only
    ("core", ("autopar.errors", "autopar.units", "autopar.profile", "autopar.mesh", "autopar.hardware",
              "autopar.cluster_presets", "autopar.cluster_schema", "autopar.cluster",
              "autopar.constraints")),
    ("models", ("autopar.models",)),      # the zoo: torch modules
    ("frontend", ("autopar.frontend",)),  # tracing, batch dims, blocks
    ("rules", ("autopar.rules",)),        # op rules, layouts, strategies, micro-batch losses
    ("pricing", ("autopar.pricing",)),    # cost and memory models, node and edge prices
    ("plans", ("autopar.plans",)),        # the plan, its file format, reports
    ("codegen", ("codegen",)),            # per-rank programs from a plan
    ("search", ("autopar.search",)),      # prices grid modes and pipeline stages with codegen's own
                                          # grid interpreter and stage split: what is priced is what runs
    ("api", ("autopar.api",)),            # autopar.plan
    ("execution", ("autopar.execution",)),  # compile (plans when given no plan), run, calibrate
    ("inference", ("autopar.inference",)),  # plan_inference, compile_inference (generation), serve
    ("top", ("autopar", "autopar.cli", "autopar.cli_args", "autopar.cli_inference", "autopar.demo",
             "autopar.train_demo")),
)

# Function-local imports that would close a cycle, kept on purpose: (importing module, imported
# module) -> why. Keep it short.
HIDDEN_CYCLES: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    module: str           # the importing module (package __init__: the package's name)
    path: pathlib.Path    # its file, relative to ROOT
    line: int
    target: str           # the imported module (``from m import x``: m.x when that is a module)
    names: tuple          # ``from m import a, b``: (a, b)
    local: bool           # inside a function
    type_only: bool       # under ``if TYPE_CHECKING:`` (never runs)


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for top in PACKAGES:
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _resolve(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imports() -> list[Import]:
    """Every import of one of PACKAGES in PACKAGES' files (relative imports are not used)."""
    mods, out = _modules(), []
    for mod, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        local, type_only = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                local |= {id(n) for n in ast.walk(node)}
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                type_only |= {id(n) for b in node.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{f}:{node.lineno}: relative import"
                names = tuple(a.name for a in node.names)
                targets = [node.module + "." + n if node.module + "." + n in mods else node.module for n in names]
            elif isinstance(node, ast.Import):
                names, targets = (), [a.name for a in node.names]
            else:
                continue
            for t in dict.fromkeys(targets):
                if t.split(".")[0] in PACKAGES:
                    out.append(Import(mod, f.relative_to(ROOT), node.lineno, _resolve(t, mods) or t, names,
                                      id(node) in local, id(node) in type_only))
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] != "autopar" or len(parts) == 1 else "autopar." + parts[1]


def layer_of(module: str) -> int:
    u = unit(module)
    for i, (_, units) in enumerate(LAYERS):
        if u in units:
            return i
    raise AssertionError(f"{module}: its unit {u} is in no layer of tests/project/test_layering.py LAYERS "
                         "(place it there and in docs/architecture.md 'Package imports')")


def _graph(local: bool) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(_modules())
    g.add_edges_from((i.module, i.target) for i in _imports()
                     if i.module != i.target and not i.type_only and (local or not i.local)
                     and (i.module, i.target) not in HIDDEN_CYCLES)
    return g


def _cycles(g: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_every_module_is_in_a_layer():
    for mod in _modules():
        layer_of(mod)


def test_imports_follow_the_layers():
    bad = []
    for i in _imports():
        a, b = layer_of(i.module), layer_of(i.target)
        if b > a:
            bad.append(f"{i.path}:{i.line}: {i.module} ({LAYERS[a][0]}) imports {i.target} ({LAYERS[b][0]})"
                       f"{' inside a function' if i.local else ''}")
    order = " < ".join(name for name, _ in LAYERS)
    assert not bad, (f"imports against the layers ({order}; a module imports only from its own layer "
                     "and those below, docs/architecture.md 'Package imports'):\n" + "\n".join(bad))


def test_no_import_cycles_at_module_level():
    cycles = _cycles(_graph(local=False))
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycles_hidden_in_functions():
    """A function-local import that closes a cycle hides it; break it by moving code instead
    (or list it in HIDDEN_CYCLES with the reason)."""
    cycles = _cycles(_graph(local=True))
    assert not cycles, ("import cycles through function-local imports:\n"
                        + "\n".join(" <-> ".join(c) for c in cycles))


def test_hidden_cycles_allowed_are_still_there():
    """Every HIDDEN_CYCLES entry is an import that exists (a stale entry would allow a new one)."""
    found = {(i.module, i.target) for i in _imports() if i.local}
    assert set(HIDDEN_CYCLES) <= found, set(HIDDEN_CYCLES) - found


def test_solver_and_runtime_import_nothing_from_the_planner_or_codegen():
    bad = [f"{i.path}:{i.line}: {i.module} imports {i.target}" for i in _imports()
           if i.module.split(".")[0] in ("solver", "runtime") and i.target.split(".")[0] in ("autopar", "codegen")]
    assert not bad, "solver/ and runtime/ must not import autopar/ or codegen/:\n" + "\n".join(bad)


def _package_dir(module: str) -> pathlib.Path:
    path = pathlib.Path(*module.split("."))
    return path if (ROOT / path).is_dir() else path.parent


def test_no_private_name_crosses_a_package():
    bad = []
    for i in _imports():
        if _package_dir(i.target) == i.path.parent:
            continue
        bad += [f"{i.path}:{i.line}: {i.module} imports {i.target}.{n}" for n in i.names
                if n.startswith("_") and not n.startswith("__") and i.target.rpartition(".")[2] != n]
    assert not bad, "private names imported across packages (make them public):\n" + "\n".join(bad)


def test_the_checks_see_the_imports_they_judge():
    """The premise: the walk finds imports, function-local ones too (a broken walk passes everything)."""
    found = _imports()
    assert len(found) > 500
    assert any(i.module == "autopar.cli" and i.target == "codegen" and i.local for i in found)   # inside a function
    assert any(i.module == "autopar.pricing.edge_price" and i.target == "autopar.pricing.price" and i.type_only
               for i in found)
    with_locals = _graph(local=True)
    with_locals.add_edge("autopar.errors", "autopar.cli")   # an upward import closes a cycle
    assert _cycles(with_locals)


def numbers() -> dict:
    imps = _imports()
    return {"modules": len(_modules()), "imports": len(imps),
            "function-local imports": sum(i.local for i in imps),
            "codegen -> autopar imports": sum(i.module.startswith("codegen") and i.target.startswith("autopar")
                                              for i in imps),
            "imports against the layers": sum(layer_of(i.target) > layer_of(i.module) for i in imps),
            "cycles at module level": _cycles(_graph(local=False)),
            "cycles through function-local imports": _cycles(_graph(local=True))}


if __name__ == "__main__":
    for k, v in numbers().items():
        print(f"{k}: {len(v) if isinstance(v, list) else v}")
        for c in v if isinstance(v, list) else ():
            print("   ", " <-> ".join(c))
