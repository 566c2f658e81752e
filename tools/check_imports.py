#!/usr/bin/env python3
"""Check the package import DAG declared in pyproject.toml [tool.tidal.import-dag].

A tidal package may import only the siblings listed for it, and only their public names (no
``tidal_x._private`` modules, no names missing from the sibling's ``__all__``). Prints one line per
violation and exits 1 if any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _string_items(node: ast.expr) -> set[str] | None:
    """Strings of a list/tuple literal, or of ``a + b`` of such literals; None for anything computed."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_items(node.left), _string_items(node.right)
        return None if left is None or right is None else left | right
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in node.elts):
        return {e.value for e in node.elts}  # type: ignore[attr-defined]
    return None


def _public_names(pkg_dir: Path) -> set[str] | None:
    """The sibling's ``__all__`` read statically from its ``__init__.py`` (None if it is not a literal)."""
    init = pkg_dir / "__init__.py"
    names: set[str] | None = None
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = _string_items(node.value)
        elif (
            isinstance(node, ast.AugAssign)
            and getattr(node.target, "id", None) == "__all__"
            and names is not None
        ):
            extra = _string_items(node.value)
            names = None if extra is None else names | extra
    return names


def main() -> int:
    dag: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["tidal"][
        "import-dag"
    ]
    src_dirs = {p.name: p for p in ROOT.glob("packages/*/src/*") if p.is_dir() and p.name in dag}
    public = {name: _public_names(path) for name, path in src_dirs.items()}
    bad = []
    for pkg, path in sorted(src_dirs.items()):
        for f in sorted(path.rglob("*.py")):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found = [(a.name, None) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found = [(node.module, [a.name for a in node.names])]
                else:
                    continue
                for module, names in found:
                    parts = module.split(".")
                    top = parts[0]
                    if top not in dag or top == pkg:
                        continue
                    where = f"{f.relative_to(ROOT)}:{node.lineno}"
                    if top not in dag[pkg]:
                        bad.append(
                            f"{where}: {pkg} imports {module}; allowed: {dag[pkg] or 'no tidal package'}"
                        )
                    elif len(parts) > 1 and parts[1] != "__about__":
                        bad.append(f"{where}: {pkg} imports {module}; import public names from {top} itself")
                    elif names and public.get(top) is not None:
                        hidden = [n for n in names if n not in public[top]]
                        if hidden:
                            bad.append(f"{where}: {pkg} imports {hidden} from {top}, not in its __all__")
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
