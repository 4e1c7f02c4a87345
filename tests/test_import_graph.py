"""The import graph of ``jaxtdist`` has no cycle (issue 32) and keeps the layer
order (issue 81): language -> kernels -> runtime -> ops -> tune, nn -> bench.

Every module under ``jaxtdist/`` is parsed with :mod:`ast` (nothing is
imported), every import of another ``jaxtdist`` module becomes an edge, and
the strongly connected components of the graph (Tarjan) must all be single
modules. A cycle makes the import order decide whether a name exists yet and
ties layers together (a registry that imports its implementations, which
import the registry), so it is refused even when Python happens to cope.
On top, every import goes down the layers of ``LAYERS``: a lower layer
never imports a higher one (the ops never import the tuner, it imports them).

The graph:

* A node is a module, named by its dotted name; a package is the node of its
  ``__init__.py`` (``jaxtdist.ops`` is ``jaxtdist/ops/__init__.py``).
* Imports at any depth count: module level, inside functions (lazy imports)
  and inside ``try`` or ``if``, since a lazy import that closes a circle is
  still two layers that need each other. Only imports under
  ``if TYPE_CHECKING:`` are left out: they never run.
* Imports by name count too: a string constant that is exactly a module's
  dotted name, or ``"module:function"`` (how the heap-backend registry names
  the factories it imports on first use), is an edge to that module, so a
  circle cannot hide behind :func:`importlib.import_module`.
* ``import a.b.c`` and ``from a.b.c import n`` run ``a``, ``a.b`` and
  ``a.b.c`` in full, so each of them is a target; ``from a.b import c`` where
  ``c`` is a submodule (a file or package ``a/b/c``) also targets ``a.b.c``.
  Relative imports are resolved against the importing module first.

The one rule for packages: a module's own ancestor packages are never a
target because of a submodule import. Python runs ``jaxtdist/ops/__init__.py``
before any ``jaxtdist.ops.*`` body, so when ``jaxtdist/ops/all_reduce.py``
says ``from jaxtdist.ops import _op`` (or ``from . import _op``, or
``import jaxtdist.ops._op``) the package is already there, possibly half
run, and Python finds the submodule regardless: the package re-exporting
``all_reduce`` in its ``__init__`` is not a circle. Asking an ancestor for a
*name* is different: ``import jaxtdist.ops`` or ``from jaxtdist import X``
where ``X`` is not a submodule needs the ancestor's ``__init__`` to have got
far enough to define ``X``, which it has not when the ancestor is what is
importing us. That is a real circle, and such an import is an edge to the
ancestor. Packages that are not ancestors of the importer are always
targets: importing them runs their ``__init__`` in full.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

PACKAGE = "jaxtdist"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

# Cycles allowed while someone else removes them: each entry is the sorted
# tuple of the modules in one strongly connected component. The forward and
# backward partners ag_matmul and matmul_rs (each one's VJP calls the other)
# are being rewritten on main by the lead, who empties this set when he
# merges. Never add to it: remove a cycle instead.
# Compiled modules of the package: built from csrc/ (CMake or Bazel) into
# jaxtdist/, absent from a source checkout, importing nothing of ours. They
# are leaves of the graph, so ``from jaxtdist import _jaxtdist_ffi`` is an
# edge to the extension and not a request for a name of jaxtdist/__init__.py.
_EXTENSIONS = ("jaxtdist._jaxtdist_ffi",)

_BEING_FIXED: frozenset[tuple[str, ...]] = frozenset()


def _module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path | None]:
    """Maps each dotted module name under ``root`` to its source file.

    A compiled extension of ``_EXTENSIONS`` maps to ``None``: a module without
    source (no imports).
    """
    modules: dict[str, pathlib.Path | None] = {
        name: None for name in _EXTENSIONS if name.split(".")[0] == root.name}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_package(name: str, files: dict[str, pathlib.Path | None]) -> bool:
    return files[name] is not None and files[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    """True for ``TYPE_CHECKING`` and ``typing.TYPE_CHECKING``."""
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute)
                and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` that can run, at any depth."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)   # only the else branch ever runs
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_from(module: str, is_package: bool,
                  node: ast.ImportFrom) -> str:
    """The absolute module named by a (possibly relative) ``from`` import."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()                      # a module's "." is its package
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _edges_of(module: str, files: dict[str, pathlib.Path | None]) -> set[str]:
    """The modules that ``module`` imports, under the rules of the docstring."""
    if files[module] is None:
        return set()                    # a compiled extension
    is_pkg = _is_package(module, files)
    # A module's ancestors: its packages, and itself when it is a package.
    ancestors = set(_prefixes(module)[:None if is_pkg else -1])
    tree = ast.parse(files[module].read_text(), filename=str(files[module]))
    targets: set[str] = set()

    def run_in_full(name: str) -> None:
        """``name`` and its packages run; ancestors are already running."""
        for prefix in _prefixes(name):
            if prefix in files and prefix not in ancestors:
                targets.add(prefix)

    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ancestors:
                    targets.add(alias.name)     # asks a running __init__
                else:
                    run_in_full(alias.name)
            continue
        source = _resolve_from(module, is_pkg, node)
        if source.split(".")[0] != PACKAGE:
            continue
        run_in_full(source)
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in files:
                run_in_full(sub)
            elif source in ancestors:
                # A name (or *) that a running __init__ may not define yet.
                targets.add(source)
    # Imports by name (``importlib.import_module(name)``, a registry's
    # "module:function" factories): a string that is exactly a module's name,
    # or a module's name and ":attribute", is an edge to that module.
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = node.value.partition(":")[0]
            if named in files and (named == node.value
                                   or node.value.count(":") == 1):
                run_in_full(named)
    targets.discard(module)
    return {t for t in targets if t.split(".")[0] == PACKAGE}


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """The intra-package import graph: module -> modules it imports."""
    files = _module_files(root)
    return {module: _edges_of(module, files) for module in files}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, for the message."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module, or of one that imports itself."""
    return [c for c in strongly_connected(graph)
            if len(c) > 1 or c[0] in graph[c[0]]]


# The package's layers, lowest first (issue 81). A module imports modules of its
# own group and of groups in lower layers only; groups sharing a layer import
# none of each other. A group is a top-level module or subpackage of jaxtdist;
# ``jaxtdist`` itself is the facade that ``import jaxtdist`` runs.
LAYERS: tuple[frozenset[str], ...] = (
    # Leaves anyone may use: they import nothing of jaxtdist.
    frozenset({"jaxtdist._version", "jaxtdist._errors", "jaxtdist._timing",
               "jaxtdist._jaxtdist_ffi", "jaxtdist.launch"}),
    frozenset({"jaxtdist.language"}),       # device-side primitives
    frozenset({"jaxtdist.kernels"}),        # pure Triton kernels
    frozenset({"jaxtdist.interpret"}),      # the CPU backend: kernels under the interpreter
    frozenset({"jaxtdist.runtime"}),
    frozenset({"jaxtdist.ops"}),
    frozenset({"jaxtdist.tune", "jaxtdist.nn"}),  # both on the ops, neither on the other
    frozenset({"jaxtdist"}),                # the facade: re-exports ops, runtime, tune
    frozenset({"jaxtdist.bench"}),
)


def group_of(module: str) -> str:
    """A module's layer group: ``jaxtdist.<first part>``, or ``jaxtdist`` itself."""
    return ".".join(module.split(".")[:2])


def layer_violations(graph: dict[str, set[str]],
                     layers: tuple[frozenset[str], ...] = LAYERS) -> list[str]:
    """Each import that does not go down the layers, and each group without a layer."""
    rank = {group: i for i, layer in enumerate(layers) for group in layer}
    found = [f"{group} has no layer in LAYERS"
             for group in sorted({group_of(m) for m in graph} - set(rank))]
    for module, targets in sorted(graph.items()):
        here = group_of(module)
        for target in sorted(targets):
            there = group_of(target)
            if here != there and rank.get(there, -1) >= rank.get(here, -1) >= 0:
                found.append(f"{module} imports {target} (layer {rank[there]} >= "
                             f"{rank[here]})")
    return found


def test_layer_order():
    found = layer_violations(import_graph())
    assert not found, ("imports against the layer order of LAYERS (lowest first):\n  "
                       + "\n  ".join(found))


def test_layer_finder_on_a_small_package(tmp_path):
    """Upward and sideways imports, lazy ones included, and unplaced groups are named."""
    root = _write(tmp_path, {
        "jaxtdist/__init__.py": "",
        "jaxtdist/ops/a.py": "def f():\n    from jaxtdist.tune import b\n",
        "jaxtdist/tune/b.py": "from jaxtdist.ops import a\nfrom jaxtdist.nn import c\n",
        "jaxtdist/nn/c.py": "from jaxtdist.ops import a\n",
        "jaxtdist/extra.py": "",
    })
    assert layer_violations(import_graph(root)) == [
        "jaxtdist.extra has no layer in LAYERS",
        "jaxtdist.ops.a imports jaxtdist.tune.b (layer 6 >= 5)",
        "jaxtdist.tune.b imports jaxtdist.nn.c (layer 6 >= 6)"]


def test_no_import_cycle():
    graph = import_graph()
    found = [c for c in cycles(graph) if tuple(c) not in _BEING_FIXED]
    message = "\n".join(
        f"  {' -> '.join(_one_cycle(graph, c))}   (component: {', '.join(c)})"
        for c in found)
    assert not found, (
        f"{len(found)} import cycle(s) in {PACKAGE}:\n{message}\n"
        "Break each one: move the shared names into a lower module, let "
        "implementations register themselves, or pass a factory.")


def test_being_fixed_is_still_a_cycle():
    """An allowlisted cycle that is gone must leave the allowlist too."""
    present = {tuple(c) for c in cycles(import_graph())}
    stale = sorted(set(_BEING_FIXED) - present)
    assert not stale, f"no longer cycles, remove from _BEING_FIXED: {stale}"


def test_graph_sees_the_package():
    """The parser finds the modules and the edges it must (guards the test)."""
    graph = import_graph()
    assert {"jaxtdist", "jaxtdist.ops", "jaxtdist.runtime",
            "jaxtdist.ops.all_reduce"} <= set(graph)
    assert "jaxtdist.ops" in graph["jaxtdist"]
    assert "jaxtdist.ops.all_reduce" in graph["jaxtdist.ops"]
    assert "jaxtdist.runtime" in graph["jaxtdist.ops._op"]


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE


@pytest.mark.parametrize("files,expected", [
    # Sibling circle through a lazy (function-level) import.
    ({"jaxtdist/__init__.py": "",
      "jaxtdist/a.py": "from jaxtdist import b\n",
      "jaxtdist/b.py": "def f():\n    from . import a\n"},
     [["jaxtdist.a", "jaxtdist.b"]]),
    # __init__ re-exports a submodule that imports a sibling submodule
    # through the package: not a circle.
    ({"jaxtdist/__init__.py": "from jaxtdist.ops import a\n",
      "jaxtdist/ops/__init__.py": "from . import a, b\n",
      "jaxtdist/ops/a.py": "from jaxtdist.ops import b\nimport jaxtdist.ops.b\n",
      "jaxtdist/ops/b.py": "x = 1\n"},
     []),
    # ... but asking the package's __init__ for a name is one.
    ({"jaxtdist/__init__.py": "from jaxtdist.ops import a\n",
      "jaxtdist/ops/__init__.py": "from .a import f\nVALUE = 1\n",
      "jaxtdist/ops/a.py": "from jaxtdist.ops import VALUE\ndef f(): pass\n"},
     [["jaxtdist.ops", "jaxtdist.ops.a"]]),
    # A submodule importing the top package by name closes a circle.
    ({"jaxtdist/__init__.py": "from . import ops\n",
      "jaxtdist/ops/__init__.py": "import jaxtdist\n"},
     [["jaxtdist", "jaxtdist.ops"]]),
    # A non-ancestor package runs its __init__ in full: registry -> impl ->
    # registry package, through a relative import two levels up.
    ({"jaxtdist/__init__.py": "",
      "jaxtdist/rt/__init__.py": "from .reg import get\n",
      "jaxtdist/rt/reg.py": "from jaxtdist.rt.impl import cpu\n",
      "jaxtdist/rt/impl/__init__.py": "",
      "jaxtdist/rt/impl/cpu.py": "from ..reg import get\n"},
     [["jaxtdist.rt.impl.cpu", "jaxtdist.rt.reg"]]),
    # A registry naming its implementation ("module:function", or a module
    # imported by importlib) that imports the registry is a circle.
    ({"jaxtdist/__init__.py": "",
      "jaxtdist/reg.py": "FACTORIES = {'cpu': 'jaxtdist.impl:make'}\n"
                         "LAZY = ['jaxtdist.other']\n",
      "jaxtdist/impl.py": "from jaxtdist.reg import FACTORIES\n",
      "jaxtdist/other.py": "'Docs naming jaxtdist.reg in prose are no edge.'\n"},
     [["jaxtdist.impl", "jaxtdist.reg"]]),
    # TYPE_CHECKING imports never run; other packages are ignored.
    ({"jaxtdist/__init__.py": "",
      "jaxtdist/a.py": "import typing\nif typing.TYPE_CHECKING:\n"
                       "    from jaxtdist import b\nimport numpy.linalg\n",
      "jaxtdist/b.py": "from jaxtdist import a\n"},
     []),
])
def test_finder_on_small_packages(tmp_path, files, expected):
    """The rules of the module docstring, each on a package made for it."""
    graph = import_graph(_write(tmp_path, files))
    assert cycles(graph) == expected


def test_backends_named_by_the_registry_resolve():
    """The built-in backends are registered by name (so the registry imports
    none): each name must import and give a callable factory."""
    import importlib

    from jaxtdist.runtime import _backend

    named = {e.name: e.factory for e in _backend._REGISTRY if isinstance(e.factory, str)}
    assert {"cpu-shared-memory", "cuda-peer"} <= set(named)
    for name, factory in named.items():
        module, _, function = factory.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name
    assert _backend._LAZY_BACKENDS["nvshmem"] == "jaxtdist.runtime._nvshmem"


@pytest.mark.parametrize("factory", ["jaxtdist.runtime._cpu", "a:b:c"])
def test_a_factory_name_without_one_colon_is_refused(factory):
    """A factory named without exactly one ':' is a ValueError saying the form."""
    from jaxtdist.runtime import _backend

    with pytest.raises(ValueError, match="'package.module:function'.*test-bad"):
        _backend.register_backend("test-bad", factory, applies=lambda s: False)
    assert "test-bad" not in _backend.backend_names()
