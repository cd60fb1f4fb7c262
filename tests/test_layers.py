"""Imports run one way: applications (cli, trial, plan, rehearse) sit above the floors they read, and no module
imports back up through the package root (`hf_pretrain/__init__.py`)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_pretrain"
APPLICATIONS = (
    "hf_pretrain.cli",
    "hf_pretrain.estimate_memory",
    "hf_pretrain.trial",
    "hf_pretrain.plan",
    "hf_pretrain.rehearse",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{target}.{alias.name}" for alias in node.names}
            submodules = {m for m in submodules if is_module(m)}  # `from .. import modeling`: a module, not a name
            found.update(submodules or {target})
    return {t for t in found if t == "hf_pretrain" or t.startswith("hf_pretrain.")}


def is_application(name: str) -> bool:
    return any(name == app or name.startswith(app + ".") for app in APPLICATIONS)


def test_nothing_imports_back_up():
    root, upward = [], []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name == "hf_pretrain":
            continue
        targets = imports_of(path)
        if "hf_pretrain" in targets:
            root.append(name)
        if not is_application(name):
            upward += [f"{name} -> {t}" for t in targets if is_application(t)]
    assert root == [], f"import the module you need, not the package root: {root}"
    assert upward == [], f"the floors import an application: {upward}"


def test_the_check_sees_relative_imports(tmp_path):
    # the rule must be able to fail: a relative import of the root from a subpackage is found
    module = PACKAGE / "data" / "perplexity.py"
    assert "hf_pretrain.modeling" in imports_of(module)
    assert module_name(PACKAGE / "data" / "__init__.py") == "hf_pretrain.data"
