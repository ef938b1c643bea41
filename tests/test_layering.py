"""The import rules of docs/architecture.md ("Package imports"), enforced on the source: every
``import`` and ``from ... import`` of the four top-level packages, function-local ones included
(parsed with ast, nothing imported).

  * solver/ and runtime/ import nothing from autopar/ or codegen/ (they are usable on their own:
    the ILP without torch, the runtime ops without the planner);
  * no private name (``_x``) is imported from another package (directory): what crosses a
    package boundary is public.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("autopar", "solver", "codegen", "runtime")


def _imports():
    """(importing module, its package dir, imported module, names) for every absolute import."""
    for top in PACKAGES:
        for f in sorted((ROOT / top).rglob("*.py")):
            rel = f.relative_to(ROOT)
            mod = ".".join(rel.with_suffix("").parts)
            for node in ast.walk(ast.parse(f.read_text(), str(rel))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    yield mod, rel.parent, node.module, [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        yield mod, rel.parent, a.name, []


def _package_dir(module: str) -> pathlib.Path:
    path = pathlib.Path(*module.split("."))
    return path if (ROOT / path).is_dir() else path.parent


def test_solver_and_runtime_import_nothing_from_the_planner_or_codegen():
    bad = [f"{mod} imports {target}" for mod, _, target, _ in _imports()
           if mod.split(".")[0] in ("solver", "runtime") and target.split(".")[0] in ("autopar", "codegen")]
    assert not bad, "solver/ and runtime/ must not import autopar/ or codegen/:\n" + "\n".join(bad)


def test_no_private_name_crosses_a_package():
    bad = []
    for mod, pkg, target, names in _imports():
        if target.split(".")[0] not in PACKAGES or _package_dir(target) == pkg:
            continue
        if (ROOT / pathlib.Path(*target.split("."))).is_dir():   # a submodule imported from its package
            continue
        bad += [f"{mod} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "private names imported across packages (make them public):\n" + "\n".join(bad)


def test_the_checks_see_the_imports_they_judge():
    """The premise: the walk finds imports, function-local ones too (a broken walk passes everything)."""
    found = list(_imports())
    assert len(found) > 500
    assert any(mod == "autopar.execution.compiled_setup" and target == "codegen.grid_rank_program"
               for mod, _, target, _ in found)   # imported inside a function there
