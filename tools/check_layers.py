"""Check how tests and plugins import mlxrunner (run in CI next to `lint-imports`, and by
tests/test_layering.py).

`lint-imports` (pyproject.toml, [tool.importlinter]) checks the core's layers and the
plugin packages' boundary; this script checks what it cannot see: the tests, and the
names imported.

Rules:
1. The core (core/mlxrunner) imports no plugin package, and its runtime modules never import
   the test helpers (mlxrunner.testing) or anything under a tests/ folder.
2. A plugin package imports mlxrunner only through the plugin author's modules,
   `mlxrunner.plugin` and `mlxrunner.nn`, each name one the module lists; its tests and
   recipes may use the user API (`mlxrunner`) and the store too; never another plugin; test
   helpers (`mlxrunner.testing`) only in its tests.
3. Tests (tests/) import `mlxrunner`, `mlxrunner.errors`, `mlxrunner.plugin`,
   `mlxrunner.testing` and subpackage packages such as `mlxrunner.decode`, never a module
   inside a subpackage (`mlxrunner.decode.speculative`; WHITE_BOX names the few that check a
   module's internals), and never a name starting with `_`. No runtime module imports a
   tests/ module or conftest.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "core" / "mlxrunner"
PLUGIN_DIRS = ("architectures", "renderers", "plugins")
SKIP_PARTS = {".git", "venv", ".venv", ".ci-venv", "build", "dist", "__pycache__", ".mlx-cuda-a",
              ".mlx-cuda-b", ".whl", ".team"}
#: the public modules a plugin package imports
PLUGIN_MODULES = ("mlxrunner.plugin", "mlxrunner.nn")
#: ... and its tests and recipes (scripts that build its models)
PLUGIN_SCRIPT_MODULES = PLUGIN_MODULES + ("mlxrunner", "mlxrunner.store")
#: tests that check a module's internals (a kernel's fallback state, stand-ins for its
#: launch) import that module itself: test file -> modules
WHITE_BOX = {
    "tests/core/test_topk.py": {"mlxrunner.decode.topk", "mlxrunner.nn.kernels"},
    "tests/core/test_constants.py": {"mlxrunner.constants", "mlxrunner.nn.kernels"},
    "tests/test_cuda_kernel_sources.py": {"mlxrunner.decode.topk", "mlxrunner.nn.attention",
                                          "mlxrunner.nn.cuda_build",
                                          "mlxrunner.nn.cuda_deltanet",
                                          "mlxrunner.nn.cuda_norms",
                                          "mlxrunner.nn.cuda_products",
                                          "mlxrunner.nn.cuda_gated",
                                          "mlxrunner.nn.cuda_rows"},
    "tests/core/test_fused_rows.py": {"mlxrunner.nn.cuda_rows"},
    "tests/core/test_fused_gated.py": {"mlxrunner.nn.cuda_gated"},
    "tests/core/test_fused_products.py": {"mlxrunner.constants", "mlxrunner.nn.cuda_build",
                                          "mlxrunner.nn.cuda_products", "mlxrunner.nn.kernels"},
    "tests/core/test_fused_norms.py": {"mlxrunner.nn.cuda_norms", "mlxrunner.nn.kernels"},
    "tests/core/test_attention.py": {"mlxrunner.nn.attention", "mlxrunner.nn.cuda_norms",
                                     "mlxrunner.nn.kernels"},
    "tests/test_folded_attention_models.py": {"mlxrunner.nn.attention", "mlxrunner.nn.kernels"},
    "tests/test_fused_decode_launches.py": {"mlxrunner.constants", "mlxrunner.nn.attention",
                                            "mlxrunner.nn.cuda_norms",
                                            "mlxrunner.nn.cuda_products", "mlxrunner.nn.linear",
                                            "mlxrunner.nn.heads"},
    "tests/core/test_kernels.py": {"mlxrunner.nn.kernels"},
    "tests/batch/test_batched_caches.py": {"mlxrunner.nn.attention"},
    "tests/core/test_cpu_products.py": {"mlxrunner.nn.kernels"},
    "tests/core/test_host_ops.py": {"mlxrunner.nn.host_build", "mlxrunner.nn.host_ops"},
    "tests/core/test_nn_deltanet.py": {"mlxrunner.nn.cuda_deltanet", "mlxrunner.nn.deltanet",
                                       "mlxrunner.nn.kernels"},
}


def python_files() -> list[Path]:
    """The tree's Python files: what git tracks or would track (virtualenvs are ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).exists()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(ROOT).parts)]


def _module_file(module: str) -> Path | None:
    """The file of a core module or package (``mlxrunner.decode`` -> its __init__.py)."""
    parts = module.split(".")[1:]
    base = CORE.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def is_package(module: str) -> bool:
    path = _module_file(module)
    return path is not None and path.name == "__init__.py"


def exported_names(module: str) -> set[str]:
    """What a core module exports: the keys of its export tables (``_EXPORTS``, ``_USER_API``,
    ``_PLUGIN_API``), ``__all__``, and names re-exported as ``import X as X``; a module with
    none of these, every name it defines or imports."""
    path = _module_file(module)
    if path is None:
        return set()
    declared: set[str] = set()
    imported: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if not isinstance(target, ast.Name):
                    continue
                if target.id in ("_EXPORTS", "_USER_API", "_PLUGIN_API") and \
                        isinstance(node.value, ast.Dict):
                    declared |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                elif target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                    declared |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
                elif target.id == "__version__":
                    declared.add("__version__")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname is not None and alias.asname == alias.name:
                    declared.add(alias.name)
                imported.add(alias.asname or alias.name)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            imported.add(node.name)
    return declared or imported


def listed_names(module: str) -> set[str]:
    """A public module's ``__all__`` when it is a literal list (``mlxrunner.nn``: what is
    not listed is internal), else what it exports."""
    path = _module_file(module)
    for node in ast.parse(path.read_text(encoding="utf-8")).body if path else []:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets) and \
                isinstance(node.value, (ast.List, ast.Tuple)):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return exported_names(module)


def plugin_packages() -> set[str]:
    found = set()
    for top in PLUGIN_DIRS:
        for pkg_init in (ROOT / top).glob("*/*/__init__.py"):
            if pkg_init.parent.name != "tests":
                found.add(pkg_init.parent.name)
    return found


def imports_of(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` per absolute import; ``from M import sub`` where ``sub`` is a
    core submodule that ``M`` does not export under that name counts as an import of
    ``M.sub``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = []
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if node.module.split(".")[0] == "mlxrunner" and _module_file(sub) is not None \
                        and alias.name not in exported_names(node.module):
                    out.append((node.lineno, sub, []))
                else:
                    names.append(alias.name)
            if names or not node.names:
                out.append((node.lineno, node.module, names))
    return out


def test_module_names() -> set[str]:
    """Top-level names of modules that live in tests/ folders (importable via pythonpath)."""
    return {p.stem for p in python_files()
            if "tests" in p.relative_to(ROOT).parts} | {"tests", "conftest"}


def is_test_path(path: Path) -> bool:
    return "tests" in path.relative_to(ROOT).parts or path.name == "conftest.py"


def test_may_import(module: str) -> bool:
    """Rule 3's modules: the public ones, test helpers, and subpackage packages."""
    if module in ("mlxrunner", "mlxrunner.errors", "mlxrunner.plugin", "mlxrunner.settings"):
        return True
    if module == "mlxrunner.testing" or module.startswith("mlxrunner.testing."):
        return True
    return module.count(".") == 1 and is_package(module)


def check() -> list[str]:
    problems: list[str] = []
    plugin_pkgs = plugin_packages()
    test_modules = test_module_names()
    exports: dict[tuple[str, bool], set[str]] = {}
    for path in python_files():
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
            if top != "mlxrunner":
                continue
            helpers = module == "mlxrunner.testing" or module.startswith("mlxrunner.testing.")
            if in_plugin:
                package_code = own_pkg is not None and rel.parts[2].startswith("mlxrunner_") \
                    and not test
                allowed = PLUGIN_MODULES if package_code else PLUGIN_SCRIPT_MODULES
                if helpers and not test:
                    problems.append(f"{where}: runtime plugin code imports test helpers")
                elif not helpers and module not in allowed and not (
                        test and module == "mlxrunner.settings"):  # tests switch settings
                    problems.append(f"{where}: plugin imports {module}: use "
                                    f"{', '.join(allowed)}")
                    continue
            elif test and not in_core:
                if not test_may_import(module) and \
                        module not in WHITE_BOX.get(rel.as_posix(), ()):
                    problems.append(f"{where}: test imports {module}: import its package "
                                    f"({module.rsplit('.', 1)[0]}) and what it exports")
                    continue
            else:
                continue
            if helpers:
                continue
            known = exports.setdefault((module, in_plugin), listed_names(module) if in_plugin
                                       else exported_names(module))
            for name in names:
                if name.startswith("_") and name != "__version__":
                    problems.append(f"{where}: imports the private name {name!r} from {module}")
                elif name not in known:
                    problems.append(f"{where}: {module} does not export {name!r}")
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print(f"layering: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
