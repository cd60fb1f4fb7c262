"""Imports run one way: each part of the package sits on a declared floor and imports only its own part or lower
floors (applications at the top), no module imports back up through the package root (`hf_pretrain/__init__.py`),
and no module imports one that imports it back. transformers' private surface is touched in one module only."""

import ast
import functools
import importlib.util
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_pretrain"
ROOT = PACKAGE.parent
# The floors, lowest first: a module imports from its own part (`hf_pretrain.<part>`) or from a lower floor.
FLOORS = (
    ("chips", "callback", "lazy"),  # facts and protocols
    ("modeling",),
    ("presets", "precision", "data"),
    ("telemetry", "evaluation"),
    ("distributed", "report"),
    # The checks before the first step price the run with the estimators below them (modeling's attention planner,
    # distributed's memory estimator) and only the trainer above runs them: a check sits over what it consults.
    ("preflight",),
    ("training",),
    ("estimate_memory", "plan", "trial", "rehearse"),  # applications: nothing below imports them
    ("cli",),
)
FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}
PRIVATE_HOME = PACKAGE / "training" / "private.py"
PATCHERS = ("setattr", "delattr", "patched")


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


@functools.cache
def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in PACKAGE.rglob("*.py")}


def part(name: str) -> str:
    return name.split(".")[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`module -> target` for every import that runs sideways or up the floors."""
    return [
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name != "hf_pretrain"
        for target in targets
        if target != "hf_pretrain" and part(target) != part(name) and FLOOR[part(target)] >= FLOOR[part(name)]
    ]


def test_every_part_has_a_floor():
    parts = {part(name) for name in import_graph() if name != "hf_pretrain"}
    assert parts - FLOOR.keys() == set(), "declare the floor of each new part in FLOORS"


def test_nothing_imports_back_up():
    graph = import_graph()
    root = [name for name, targets in graph.items() if name != "hf_pretrain" and "hf_pretrain" in targets]
    assert root == [], f"import the module you need, not the package root: {root}"
    assert upward_imports(graph) == [], "an import runs sideways or up the floors (FLOORS)"


def test_the_floor_check_can_fail():
    assert upward_imports({"hf_pretrain.precision.recipes": {"hf_pretrain.telemetry.peaks"}}) == [
        "hf_pretrain.precision.recipes -> hf_pretrain.telemetry.peaks"
    ]
    assert upward_imports({"hf_pretrain.data.read": {"hf_pretrain.precision.recipes"}})  # sideways
    assert upward_imports({"hf_pretrain.training.wiring": {"hf_pretrain.plan.planner"}})  # an application
    assert not upward_imports({"hf_pretrain.telemetry.throughput": {"hf_pretrain.precision.recipes"}})


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each import cycle (strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    # every edge counts, into a package's __init__ too (an __init__ re-exports: its own edges lead on to its modules)
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check can fail


def packages() -> list[str]:
    return sorted(module_name(path) for path in PACKAGE.rglob("__init__.py"))


def folder_cycles(graph: dict[str, set[str]]) -> list[tuple[str, list[str]]]:
    """Inside each package, its modules and sub-folders as rooms (a folder is one room): the cycles between rooms.
    `pipeline_config -> engines/config` beside `engines/stages -> pipeline_config` is one, though no module cycle."""
    found = []
    for package in packages():
        rooms: dict[str, set[str]] = {}
        for name, targets in graph.items():
            if (source := room(package, name)) is not None:
                inside = {room(package, target) for target in targets}
                rooms.setdefault(source, set()).update(inside - {None, source})
        found += [(package, cycle) for cycle in cycles(rooms)]
    return found


def room(package: str, name: str) -> str | None:
    """The room of module `name` in `package`: its module or sub-folder there; None outside the package."""
    return name.split(".")[package.count(".") + 1] if name.startswith(package + ".") else None


def test_no_import_runs_back_up_between_the_folders_of_a_package():
    assert folder_cycles(import_graph()) == []
    loop = {
        "hf_pretrain.data.pipeline_config": {"hf_pretrain.data.engines.config"},
        "hf_pretrain.data.engines.stages": {"hf_pretrain.data.pipeline_config"},
        "hf_pretrain.data.read": {"hf_pretrain.data.blocks"},
    }
    assert ("hf_pretrain.data", ["engines", "pipeline_config"]) in folder_cycles(loop)  # the check can fail


def holds_code(source: str) -> bool:
    """More than a docstring, imports and assignments (re-export tables, `__getattr__ = lazy_getattr(...)`)."""
    allowed = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign)
    docstring = lambda node: isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)  # noqa: E731
    return any(not (isinstance(node, allowed) or docstring(node)) for node in ast.parse(source).body)


def test_a_package_init_holds_re_exports_only():
    # the package root excepted: it is the import hook that registers the model with transformers' auto classes
    # and filters two import-time messages (its docstring says why), and nothing imports it (test above)
    inits = [PACKAGE.parent / name.replace(".", "/") / "__init__.py" for name in packages() if name != "hf_pretrain"]
    holding = [str(path.relative_to(ROOT)) for path in inits if holds_code(path.read_text())]
    assert holding == [], "move the code into a module of the package and re-export it"
    assert holds_code("def f():\n    pass\n") and holds_code("register(A)\n")  # the check can fail
    assert not holds_code('"""Doc."""\nfrom .a import b\n__all__ = ["b"]\n')


# transformers' private surface: one module (training/private.py) overrides private Trainer
# methods, touches its private attributes and patches transformers.trainer's globals.
def trainer_private_names() -> set[str]:
    """`Trainer`'s private methods and attributes, read off transformers' source (importing it takes seconds)."""
    (folder,) = importlib.util.find_spec("transformers").submodule_search_locations  # imports nothing
    source = (Path(folder) / "trainer.py").read_text()
    (trainer,) = (node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    methods = {node.name for node in trainer.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    attributes = set(re.findall(r"self\.(_[a-z]\w*)\s*=", source))
    return {name for name in methods | attributes if name.startswith("_") and not name.startswith("__")}


def _transformers_module(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The transformers module `node` names (`transformers.trainer`, an alias of `transformers.modeling_utils`,
    ...), or None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    dotted = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
    parts = dotted.split(".")
    if len(parts) > 1 and parts[0] == "transformers" and all(part.isidentifier() and part.islower() for part in parts):
        return dotted  # modules only: `transformers.Trainer.__init__ = ...` patches a public class, not a global
    return None


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """`import transformers.X as y` and `from transformers[.P] import x` (a module: lower case): alias -> module."""
    aliases = {}
    for node in ast.walk(tree):
        for alias in getattr(node, "names", ()):
            if isinstance(node, ast.Import) and alias.name.startswith("transformers.") and alias.asname:
                aliases[alias.asname] = alias.name
            from_transformers = isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers"
            if from_transformers and alias.name.islower():  # a module (classes and constants are not patched here)
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def private_surface_uses(source: str, private: set[str]) -> list[str]:
    """Where `source` patches a global of a transformers module, defines a private Trainer method in a Trainer
    class or reads / writes a private Trainer attribute (`self._x` of a class that is no Trainer is its own)."""
    tree = ast.parse(source)
    aliases = _module_aliases(tree)
    uses = []

    def visit(node: ast.AST, in_trainer: bool) -> None:
        if isinstance(node, ast.ClassDef):
            in_trainer = any("Trainer" in ast.unparse(base) for base in node.bases)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and in_trainer and item.name in private:
                    uses.append(f"line {item.lineno}: overrides Trainer.{item.name}")
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and (module := _transformers_module(target.value, aliases)):
                uses.append(f"line {node.lineno}: assigns {module}.{target.attr}")
        function = node.func if isinstance(node, ast.Call) else None
        patching = getattr(function, "id", getattr(function, "attr", None)) in PATCHERS
        if patching and node.args and (module := _transformers_module(node.args[0], aliases)):
            uses.append(f"line {node.lineno}: patches {module}")
        if isinstance(node, ast.Attribute) and node.attr in private:
            own = isinstance(node.value, ast.Name) and node.value.id == "self" and not in_trainer
            if not own:
                uses.append(f"line {node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, in_trainer)

    visit(tree, False)
    return uses


def test_private_surface_has_one_home():
    private = trainer_private_names()
    found = {}
    for folder in ("hf_pretrain", "examples", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != PRIVATE_HOME and (uses := private_surface_uses(path.read_text(), private)):
                found[str(path.relative_to(ROOT))] = uses
    assert found == {}, "move it into training/private.py"


def test_the_private_surface_check_can_fail():
    private = trainer_private_names()
    assert "_save" in private and "_created_lr_scheduler" in private
    patch = "import transformers.trainer as hf_trainer\nhf_trainer.skip_first_batches = None\n"
    assert private_surface_uses(patch, private) == ["line 2: assigns transformers.trainer.skip_first_batches"]
    assert private_surface_uses("import transformers\nsetattr(transformers.trainer, 'x', 1)\n", private)
    utils = "import transformers.modeling_utils as m\nm.safe_save_file = None\n"
    assert private_surface_uses(utils, private) == ["line 2: assigns transformers.modeling_utils.safe_save_file"]
    imported = "from transformers import modeling_utils\npatched(modeling_utils, 'safe_save_file', None)\n"
    assert private_surface_uses(imported, private) == ["line 2: patches transformers.modeling_utils"]
    assert private_surface_uses("import transformers\ntransformers.trainer_utils.x = 1\n", private)
    override = "class T(PretrainTrainer):\n    def _run_epoch(self, **kw):\n        return super()._run_epoch(**kw)\n"
    assert len(private_surface_uses(override, private)) == 2  # the override, and its call of the private method
    assert private_surface_uses("def f(trainer):\n    trainer._save('x')\n", private) == ["line 2: trainer._save"]
    own = "class Store:\n    def _save(self):\n        return self._save\n"
    assert private_surface_uses(own, private) == []


def test_the_check_sees_relative_imports(tmp_path):
    # the rule must be able to fail: a relative import of the root from a subpackage is found
    module = PACKAGE / "data" / "perplexity.py"
    assert "hf_pretrain.modeling" in imports_of(module)
    assert module_name(PACKAGE / "data" / "__init__.py") == "hf_pretrain.data"


def imports_of_tests(source: str) -> list[str]:
    """The `tests` modules a source imports (absolute imports whose first name is `tests`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        found += [n for n in names if n.split(".")[0] == "tests"]
    return found


def test_shipped_code_never_imports_the_tests():
    """The package, the examples and the benchmarks run from an installed wheel or a checkout without tests/."""
    shipped = [p for folder in ("hf_pretrain", "examples", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    found = {str(p.relative_to(ROOT)): imports_of_tests(p.read_text()) for p in shipped}
    assert not {path: names for path, names in found.items() if names}


def test_the_tests_import_check_can_fail():
    assert imports_of_tests("from tests.data.engine_clusters import slurm_cluster") == ["tests.data.engine_clusters"]
    assert imports_of_tests("import tests.conftest, os") == ["tests.conftest"]
    assert imports_of_tests("from .tests import x\nfrom engine_clusters import y\nimport testsuite") == []
