"""Check the import layering of the monorepo (run in CI, and by tests/test_layering.py).

Rules:
1. The core (core/mlxrunner) imports no plugin package, and its runtime modules never import
   the test helpers (mlxrunner.testing) or anything under a tests/ folder.
2. A plugin's runtime code imports mlxrunner only through its public API (`import mlxrunner`,
   `from mlxrunner import NAME` with NAME exported), never another plugin, never test helpers.
3. Tests may import mlxrunner.testing; no runtime module imports a tests/ module or conftest.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIRS = ("architectures", "renderers", "plugins")
SKIP_PARTS = {".git", "venv", ".venv", ".ci-venv", "build", "dist", "__pycache__", ".mlx-cuda-a",
              ".mlx-cuda-b", ".whl", ".team"}


def python_files() -> list[Path]:
    """The tree's Python files: what git tracks or would track (virtualenvs are ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).exists()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(ROOT).parts)]


def public_names() -> set[str]:
    init = (ROOT / "core" / "mlxrunner" / "__init__.py").read_text()
    block = init[init.index("_EXPORTS"):init.index("}", init.index("_EXPORTS"))]
    return set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)":', block)) | {"__version__"}


def plugin_packages() -> set[str]:
    found = set()
    for top in PLUGIN_DIRS:
        for pkg_init in (ROOT / top).glob("*/*/__init__.py"):
            if pkg_init.parent.name != "tests":
                found.add(pkg_init.parent.name)
    return found


def imports_of(path: Path) -> list[tuple[int, str, list[str]]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def test_module_names() -> set[str]:
    """Top-level names of modules that live in tests/ folders (importable via pythonpath)."""
    return {p.stem for p in python_files()
            if "tests" in p.relative_to(ROOT).parts} | {"tests", "conftest"}


def is_test_path(path: Path) -> bool:
    return "tests" in path.relative_to(ROOT).parts or path.name == "conftest.py"


def check() -> list[str]:
    problems: list[str] = []
    public = public_names()
    plugin_pkgs = plugin_packages()
    test_modules = test_module_names()
    files = python_files()
    for path in files:
        rel = path.relative_to(ROOT)
        in_core = rel.parts[:2] == ("core", "mlxrunner")
        in_testing = in_core and len(rel.parts) > 2 and rel.parts[2] == "testing"
        in_plugin = rel.parts[0] in PLUGIN_DIRS
        test = is_test_path(path)
        own_pkg = rel.parts[2] if in_plugin and len(rel.parts) > 3 else None
        for line, module, names in imports_of(path):
            top = module.split(".")[0]
            where = f"{rel}:{line}"
            if not test and (top in test_modules or module.endswith(".conftest")):
                problems.append(f"{where}: runtime code imports test module {module}")
            if in_core and top in plugin_pkgs:
                problems.append(f"{where}: the core imports plugin {module}")
            if in_core and not in_testing and not test and module.startswith("mlxrunner.testing"):
                problems.append(f"{where}: runtime core code imports test helpers {module}")
            if in_plugin and top in plugin_pkgs and top != own_pkg and not test:
                problems.append(f"{where}: plugin imports another plugin ({module})")
            if in_plugin and top == "mlxrunner":
                allowed = module == "mlxrunner" or (test and module.startswith("mlxrunner.testing"))
                if not allowed:
                    problems.append(f"{where}: plugin imports {module}: use mlxrunner's "
                                    "public API (`from mlxrunner import ...`)")
                elif module == "mlxrunner":
                    for name in names:
                        if name not in public and name != "testing":
                            problems.append(f"{where}: {name!r} is not in mlxrunner's public API")
                        if name == "testing" and not test:
                            problems.append(f"{where}: runtime plugin code imports test helpers")
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print(f"layering: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
