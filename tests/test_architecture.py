"""The import graph of the product code has no cycle, and the code keeps the shape docs/ARCHITECTURE.md draws.

Every product module (the top-level *.py files and the packages `engines/`, `models/`, `reward_models/`,
`training/`, `data_prep/`) is parsed with `ast`, never imported, and every import in it counts: module level, inside
functions, under `TYPE_CHECKING`, relative (`from . import x`, `from .flags import y`). An edge A -> B means module A
imports project module B (`from pkg import name` points at `pkg.name` when that is a module, else at `pkg`). The rollout code is
layered (`engines/__init__.py`); a cycle anywhere is reported as its path, e.g. `a -> b -> a`. A name that crosses
a module is public: no product module imports or reads another project module's `_name`. `training/__init__.py`
exports only what the two trainers and the user scripts call; everything else is imported from its module.
Folders by audience: `scripts/` holds what users run, `tools/` what developers run (benchmarks, test fixtures, the
ocr_mini pretrainer); tools may import the product code and scripts/, but neither imports tools.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("engines", "models", "reward_models", "training", "data_prep")


def product_modules(root: Path, packages: tuple[str, ...] = PRODUCT_PACKAGES) -> dict[str, Path]:
    """{dotted module name: file} of the top-level *.py files of `root` and every *.py file under `packages`
    (a package's `__init__.py` is the package's own name)."""
    modules = {path.stem: path for path in sorted(root.glob("*.py"))}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_source(node: ast.ImportFrom, package: str) -> str:
    """The dotted module a `from ... import` statement in package `package` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".") if package else []
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported_names(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` (file `path`) imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        # `import a.b.c` / `from a.b.c import x`: the deepest prefix that is a project module
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in modules:
                found.add(candidate)
                return

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = import_source(node, package)
            for alias in node.names:
                submodule = f"{source}.{alias.name}" if source else alias.name
                if submodule in modules:  # `from pkg import submodule`
                    found.add(submodule)
                elif source:
                    add(source)
    found.discard(name)
    return found


def import_graph(root: Path, packages: tuple[str, ...] = PRODUCT_PACKAGES) -> dict[str, set[str]]:
    """{module: the project modules it imports} over `product_modules(root, packages)`."""
    modules = product_modules(root, packages)
    return {name: _imported_names(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None



def private_names_across_modules(root: Path, packages: tuple[str, ...] = PRODUCT_PACKAGES) -> list[str]:
    """Every use of another project module's private name (`_name`, not a dunder) in the product code, as
    "module:line: text": `from X import _name` in any form (absolute, relative, inside functions) where X or
    X._name is a project module, and `alias._name` where `alias` is bound in that file by an import of a
    project module (`import a.b as alias`, `from pkg import module`, `import pkg`)."""
    modules = product_modules(root, packages)

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found: list[str] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        aliases: dict[str, str] = {}  # a name bound to a project module in this file -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        aliases[alias.asname] = alias.name
                    elif not alias.asname and alias.name.split(".")[0] in modules:
                        aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                source = import_source(node, package)
                for alias in node.names:
                    submodule = f"{source}.{alias.name}" if source else alias.name
                    if submodule in modules and submodule != name:
                        aliases[alias.asname or alias.name] = submodule
                    if private(alias.name) and source in modules and source != name:
                        found.append(f"{name}:{node.lineno}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                    and aliases.get(node.value.id, name) != name):
                found.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return sorted(found)


TRAINING_CALLERS = ("train_nft.py", "train_dppo.py", "scripts/sample.py", "scripts/evaluate.py",
                    "scripts/export_adapter.py")  # the files `training/__init__.py` exports for
TRAINING_EXPORTS_MAX = 40


def package_names_used(path: Path, package: str, submodules: set[str]) -> set[str]:
    """The names file `path` reads from package `package` itself, anywhere in the file: `alias.name` where `alias`
    is bound by `import package [as alias]`, and `from package import name`. A submodule (`alias.checkpoint`,
    `from package import checkpoint`) is no name of the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name == package}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module == package:
            used |= {alias.name for alias in node.names if alias.name not in submodules}
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
              and node.attr not in submodules):
            used.add(node.attr)
    return used


def test_the_product_code_has_no_import_cycle():
    graph = import_graph(REPO)
    # the graph covers what it must: the trainers' module, the layers, and imports inside functions
    assert {"rollout", "train_nft", "train_dppo", "losses", "rewards", "engines.sampler", "engines.worker",
            "engines.vllm_omni_pipelines", "models.base", "training.rollouts", "data_prep.dataset"} <= set(graph)
    assert "engines.sampler" in graph["engines.vllm_omni_pipelines"]
    assert "rollout" in graph["training.rollouts"]  # `import rollout` inside a function
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_rollout_layers_import_only_lower_layers():
    order = ["engines.sampler", "engines.contract", "engines.layout", "engines.native", "engines.vllm_omni",
             "engines.vllm_omni_pipelines", "engines.protocol", "engines.worker", "rollout"]
    same_level = {"engines.native", "engines.vllm_omni", "engines.vllm_omni_pipelines"}
    graph = import_graph(REPO)
    for i, module in enumerate(order):
        for target in graph[module]:
            if target in order:
                assert order.index(target) < i and not {module, target} <= same_level, \
                    f"{module} imports {target}, a layer at or above its own"
    assert graph["engines.vllm_omni_pipelines"] & set(order) == {"engines.sampler"}
    assert graph["engines"] == set()  # the package's __init__ stays import-light
    # no arrow up (docs/ARCHITECTURE.md): the worker's step profiler is `engines.profiler`, a leaf that training/ imports
    upward = {(m, t) for m in order for t in graph[m] if t.split(".")[0] in ("training", "train_nft", "train_dppo")}
    assert upward == set(), f"the rollout layers import training/ or a trainer: {sorted(upward)}"
    assert "engines.profiler" in graph["engines.worker"] and "engines.profiler" in graph["training.profiling"]
    assert graph["engines.profiler"] == set()


def test_the_lower_layers_never_import_the_upper_ones():
    """The picture of docs/ARCHITECTURE.md below the trainers: models/, reward_models/, losses and rewards import
    neither training/, the trainers, rollout nor engines/; data_prep/dataset.py (the loader training/ reads) imports
    no project module; data_prep's converters may import models and rewards, but nothing below imports data_prep
    except training/ reading the loader."""
    graph = import_graph(REPO)
    upper = ("training", "train_nft", "train_dppo", "rollout", "engines")
    lower = [m for m in graph if m.split(".")[0] in ("models", "reward_models", "losses", "rewards")]
    assert lower
    upward = sorted((m, t) for m in lower for t in graph[m] if t.split(".")[0] in upper)
    assert upward == [], f"lower layers import upper ones: {upward}"
    assert graph["data_prep.dataset"] == set()
    into_data_prep = sorted((m, t) for m, targets in graph.items() for t in targets
                            if t.split(".")[0] == "data_prep" and m.split(".")[0] != "data_prep"
                            and t != "data_prep.dataset")
    assert into_data_prep == [], f"modules outside data_prep import its converters: {into_data_prep}"


def test_the_checker_finds_a_cycle(tmp_path):
    """A synthetic tree: a -> pkg.b (inside a function) -> pkg.c (relative) -> a, next to an acyclic part."""
    (tmp_path / "a.py").write_text("import os\n\ndef f():\n    from pkg.b import g\n    return g\n")
    (tmp_path / "d.py").write_text("import a\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "b.py").write_text("from . import c\n\ndef g():\n    return c\n")
    (tmp_path / "pkg" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"a": {"pkg.b"}, "d": {"a"}, "pkg": set(), "pkg.b": {"pkg.c"}, "pkg.c": {"a"}}
    assert find_cycle(graph) == ["a", "pkg.b", "pkg.c", "a"]
    (tmp_path / "pkg" / "c.py").write_text("import os\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None
    # the same loop through `from ..x import y` two levels down
    (tmp_path / "pkg" / "sub").mkdir()
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from ..b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("import pkg.sub\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == ["pkg.b", "pkg.sub", "pkg.b"]



def test_no_module_uses_a_private_name_of_another():
    """A name that crosses a module is public: no product module imports or reads another's `_name`."""
    found = private_names_across_modules(REPO)
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_checker_finds_each_form(tmp_path):
    """A synthetic tree: the forms that must be found (absolute, relative, two levels up, inside a function, through
    an `import ... as` alias and a `from pkg import module` alias) and the ones that must not (a module's own
    `_name`, dunders, `self._x`, an attribute of a non-project module)."""
    (tmp_path / "a.py").write_text("import os\n_secret = 1\n__version__ = '1'\nx = os._exit\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "b.py").write_text("def _helper():\n    return _helper\n")
    (tmp_path / "pkg" / "c.py").write_text("from a import __version__\nclass C:\n    def f(self):\n"
                                           "        return self._x\n")
    (tmp_path / "d.py").write_text("import a\nprint(a.__name__)\n")
    assert private_names_across_modules(tmp_path, ("pkg",)) == []
    (tmp_path / "pkg" / "c.py").write_text("from .b import _helper\n\ndef f():\n    from a import _secret\n")
    (tmp_path / "d.py").write_text("import a\nimport pkg.b as bee\nfrom pkg import b\nprint(a._secret, bee._helper, "
                                   "b._helper)\n")
    (tmp_path / "pkg" / "sub").mkdir()
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from ..b import _helper\n")
    assert private_names_across_modules(tmp_path, ("pkg",)) == [
        "d:4: a._secret (a)", "d:4: b._helper (pkg.b)", "d:4: bee._helper (pkg.b)",
        "pkg.c:1: from pkg.b import _helper", "pkg.c:4: from a import _secret", "pkg.sub:1: from pkg.b import _helper"]


def names_imported_outside_all(root: Path, packages: tuple[str, ...] = PRODUCT_PACKAGES) -> list[str]:
    """Every `from X import name` in the product code where project module X lists its public names in a literal
    `__all__` that lacks `name` (and `name` is not a submodule of X), as "module:line: from X import name"."""
    modules = product_modules(root, packages)
    public: dict[str, set[str]] = {}
    for name, path in modules.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                public[name] = set(ast.literal_eval(node.value))
    found: list[str] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                source = import_source(node, package)
                for alias in node.names:
                    if (source in public and source != name and alias.name not in public[source]
                            and f"{source}.{alias.name}" not in modules):
                        found.append(f"{name}:{node.lineno}: from {source} import {alias.name}")
    return sorted(found)


def test_a_module_with_an_all_list_is_imported_only_by_the_names_it_lists():
    """`__all__` says what a module offers the others: a name imported from it elsewhere is in it."""
    found = names_imported_outside_all(REPO)
    assert not found, "names imported but missing from their module's __all__:\n" + "\n".join(found)


def test_the_all_list_checker_finds_an_unlisted_name(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "b.py").write_text("__all__ = ['shown']\nshown = hidden = 1\n")
    (tmp_path / "pkg" / "c.py").write_text("from .b import shown\n\ndef f():\n    from pkg.b import hidden\n")
    (tmp_path / "d.py").write_text("from pkg import b\n")  # a submodule, not a name of pkg's __all__
    assert names_imported_outside_all(tmp_path, ("pkg",)) == ["pkg.c:4: from pkg.b import hidden"]


def test_the_checker_reads_the_real_tree_without_importing_it():
    """Parsing only: the graph is built from source text (e.g. vllm-omni, absent here, is never imported). Run in a
    fresh interpreter, where no earlier test has imported the project."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_architecture as a; "
            "g = a.import_graph(a.REPO); assert 'engines.vllm_omni_pipelines' in g; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('rollout', 'engines', 'training', 'models', 'vllm_omni', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "tests")], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_training_exports_each_name_from_the_module_named_for_its_job():
    """Each name `import training as T` gives is imported explicitly (no `import *`) from the one module whose
    `__all__` lists it, and classes and functions are defined there (not re-exported from elsewhere)."""
    import importlib

    import training as T

    source = (REPO / "training" / "__init__.py").read_text(encoding="utf-8")
    imports = [node for node in ast.parse(source).body if isinstance(node, ast.ImportFrom)]
    assert imports and not [a.name for node in imports for a in node.names if a.name == "*"]
    owner: dict[str, str] = {}
    for node in imports:
        if node.level != 1:
            continue  # `from __future__ import annotations`
        module = importlib.import_module(f"training.{node.module}")
        for alias in node.names:
            name = alias.name
            assert name not in owner, f"{name} is imported from both training.{owner[name]} and training.{node.module}"
            owner[name] = node.module
            if not name.startswith("_"):
                assert name in module.__all__, f"training.{node.module} does not list {name} in __all__"
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                assert value.__module__ == f"training.{node.module}", f"{name} is defined in {value.__module__}"
    assert sorted(owner) == sorted(T.__all__)  # what it imports is what it exports, each name once


def test_training_exports_only_what_the_trainers_and_user_scripts_call():
    """`training.__all__` is the small public face: at most TRAINING_EXPORTS_MAX names, each one used by a trainer
    or a user script (TRAINING_CALLERS, read with `ast`), and every name they read from the package is exported.
    Everything else (tests, benches, tools) imports from the defining module, e.g. `from training.optim import
    GradStepper`."""
    import training as T

    submodules = {name.split(".", 1)[1] for name in product_modules(REPO) if name.startswith("training.")}
    used = set().union(*(package_names_used(REPO / caller, "training", submodules) for caller in TRAINING_CALLERS))
    assert used, "the trainers and scripts read no name of training/: the scan is broken"
    exported = set(T.__all__)
    assert len(T.__all__) == len(exported) <= TRAINING_EXPORTS_MAX, \
        f"training exports {len(T.__all__)} names (at most {TRAINING_EXPORTS_MAX}, each once)"
    assert not exported - used, ("training exports names no trainer or user script calls (import them from their "
                                 f"module instead): {sorted(exported - used)}")
    assert not used - exported, \
        f"the trainers or user scripts read names training does not export: {sorted(used - exported)}"


def test_the_package_name_scan_finds_each_form(tmp_path):
    """`alias.name` (module level and inside a function, under any alias) and `from package import name` count; a
    submodule, another package's attribute and a `from package.sub import name` do not."""
    (tmp_path / "a.py").write_text("import training as T\nimport other\nfrom training import checkpoint, setup_run\n"
                                   "from training.optim import GradStepper\n\ndef f():\n    import training\n"
                                   "    return T.run_cli, T.logs.timer, training.timer, other.image_grid\n")
    assert package_names_used(tmp_path / "a.py", "training", {"checkpoint", "logs", "optim"}) == {
        "setup_run", "run_cli", "timer"}


def tool_modules(root: Path) -> set[str]:
    """The names under which `tools/` code can be imported: `tools` itself and each module or package in it (the
    benches and fixtures put `tools/` on sys.path and import each other by bare name, e.g. `import build_tiny_models`)."""
    folder = root / "tools"
    return {"tools"} | {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def imports_of_tools(root: Path, packages: tuple[str, ...] = PRODUCT_PACKAGES) -> list[str]:
    """Every import of tools/ code, anywhere in a product module or a user script (scripts/*.py), as "file:line:
    module"; `from tools import x` and `import tools.x.y` count like `import build_tiny_models`."""
    tools = tool_modules(root)
    files = sorted(product_modules(root, packages).values()) + sorted((root / "scripts").glob("*.py"))
    found: list[str] = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(root)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[0] in tools]
    return found


def test_neither_the_product_code_nor_the_user_scripts_import_tools():
    """The arrow points one way: tools/ (benches, fixtures, the ocr_mini pretrainer) may import the product code and
    scripts/, never the reverse. (scripts/run_demo.sh runs tools/build_tiny_models.py for its tiny model: a command,
    not an import.)"""
    assert {"build_tiny_models", "trainer_runs", "bench_step", "pretrain_ocr_mini"} <= tool_modules(REPO)
    found = imports_of_tools(REPO)
    assert not found, "product modules or user scripts import tools/:\n" + "\n".join(found)


def test_scripts_holds_only_what_users_run():
    """Every Python file in scripts/ is a command (a `__main__` entry point), none is a bench or a fixture, and no
    name is both a script and a tool (one bare-name import path for each)."""
    scripts = sorted((REPO / "scripts").glob("*.py"))
    assert scripts and all("__name__ == \"__main__\"" in p.read_text(encoding="utf-8") for p in scripts), scripts
    names = {p.stem for p in (REPO / "scripts").iterdir()}
    assert not {n for n in names if n.startswith(("bench_", "build_", "check_"))}, sorted(names)
    assert not names & tool_modules(REPO)


def test_the_tools_import_scan_finds_each_form(tmp_path):
    """A synthetic tree: `import tools.x`, `from tools import x`, a bare tool module inside a function, in a product
    module and in a user script; a relative import and an unrelated module do not count."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "__init__.py").write_text("")
    (tmp_path / "tools" / "bench_x.py").write_text("import rollout\n")
    (tmp_path / "tools" / "pkg").mkdir()
    (tmp_path / "tools" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "user.py").write_text("def f():\n    import bench_x\n")
    (tmp_path / "rollout.py").write_text("import os\nfrom tools import pkg\nimport tools.pkg.a as a\n")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "__init__.py").write_text("from . import tools_like\nimport toolsmith\n")
    assert imports_of_tools(tmp_path, ("engines",)) == [
        "rollout.py:2: tools", "rollout.py:3: tools.pkg.a", "scripts/user.py:2: bench_x"]



MAX_MODULE_LINES = 700
MAX_UPDATE_DEPTH = 4  # the `with T.timer("update_actor")`, one loop over the micro-steps, and a body of if / if-elif


def block_depth(node: ast.AST) -> int:
    """How many compound statements nest at most from `node` down, `node` included when it is one (an `elif` is a
    branch of its `if`, not a block inside it)."""
    compound = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try, ast.Match)
    own = 1 if isinstance(node, compound) else 0
    children = []
    for field in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(node, field, []) or []:
            is_elif = (field == "orelse" and isinstance(node, ast.If) and isinstance(child, ast.If)
                       and child.col_offset == node.col_offset)  # `else:` + an indented `if` is one deeper
            children.append(block_depth(child) - (1 if is_elif else 0))
    return own + max(children, default=0)


def update_loop(path: Path) -> ast.With:
    """The trainer's `with T.timer("update_actor", ...)` block."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.With) and any(
                isinstance(item.context_expr, ast.Call) and item.context_expr.args
                and isinstance(item.context_expr.args[0], ast.Constant)
                and item.context_expr.args[0].value == "update_actor" for item in node.items):
            return node
    raise AssertionError(f"{path.name}: no `with T.timer(\"update_actor\", ...)` block")


def test_no_product_module_is_over_700_lines():
    long = {name: n for name, path in product_modules(REPO).items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"product modules over {MAX_MODULE_LINES} lines: {long}"


def test_each_trainers_update_loop_reads_at_most_four_blocks_deep():
    depths = {name: block_depth(update_loop(REPO / name)) for name in ("train_nft.py", "train_dppo.py")}
    assert all(d <= MAX_UPDATE_DEPTH for d in depths.values()), depths


def step_loop(path: Path) -> ast.For:
    """The trainer's `for step in ...:` loop, the whole RL step."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == "step":
            return node
    raise AssertionError(f"{path.name}: no `for step in ...:` loop")


def test_each_trainers_whole_step_reads_at_most_four_blocks_deep():
    """The step loop included: the update loop inside it, and every other phase of the step (e.g. Flow-DPPO's
    recompute of the old log-probs, a helper of its own) sit at most four blocks deep."""
    depths = {name: block_depth(step_loop(REPO / name)) for name in ("train_nft.py", "train_dppo.py")}
    assert all(d <= MAX_UPDATE_DEPTH for d in depths.values()), depths


def test_block_depth_counts_nesting_and_not_elif():
    tree = ast.parse("with a:\n    for x in y:\n        if p:\n            f()\n        elif q:\n            g()\n"
                     "        else:\n            if r:\n                while s:\n                    h()\n")
    assert block_depth(tree.body[0]) == 5  # with > for > if(else) > if > while
    flat = ast.parse("with a:\n    for x in y:\n        if p:\n            f()\n        elif q:\n            g()\n")
    assert block_depth(flat.body[0]) == 3
