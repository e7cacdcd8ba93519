"""bpsctl's modules in layers: a module imports from its own layer or the ones below it, never
from a layer above, and no chain of imports leads back to where it started. Imports are read
from the source (``ast``), function-level ones included: a lazy import is a dependency too,
only deferred.

The order of the layers is written down here and nowhere else (:data:`LAYERS`).
"""
from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bpsctl"

#: top to bottom; each entry a layer of modules and packages (a package takes its submodules)
LAYERS: list[tuple[str, ...]] = [
    ("bpsctl.cli",),                    # `bpsctl`: every command group
    ("bpsctl.trace",),                  # `bpsctl trace`: merges and draws timelines
    ("bpsctl.tune",),                   # `bpsctl tune`: runs benchmarks to pick the knobs
    ("bpsctl.chaos",),                  # faults injected into a running emulated cluster
    ("bpsctl.bench",),                  # `bpsctl bench` and its worker programs
    ("bpsctl.cliutil",),                # what the command groups share (typer, rich)
    ("bpsctl.launch",),                 # clusters: local, emulated, SSH, Slurm, Kubernetes
    ("bpsctl.engine",),                 # the parameter server and its framework plugins
    ("bpsctl.config",),                 # BPSCTL_* settings and the config file
    ("bpsctl.model", "bpsctl.errors", "bpsctl"),   # the traffic model; errors; __version__
]

#: (importing module, imported module): imports that go against the layers or close a loop,
#: each with the reason it has to
ALLOWED: dict[tuple[str, str], str] = {
    # Horovod's basics (cross_rank, cross_size) sit below its collectives, which re-export
    # them; on hosts of unequal worker counts cross_rank needs one collective to learn the
    # layout, imported when it is first called
    ("bpsctl.engine.torch.basics", "bpsctl.engine.torch.mpi_ops"):
        "cross_rank on an irregular layout asks the other ranks (mpi_ops._exchange_ints)",
}


@dataclass(frozen=True)
class Import:
    source: str         # the importing module
    target: str         # the bpsctl module it names
    path: Path
    line: int
    text: str           # the import statement as written

    def where(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}: {self.text}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _statements(nodes: list[ast.AST]) -> Iterator[ast.AST]:
    """Every statement in ``nodes`` and in the blocks inside them (an import is a statement:
    expressions need no visit)."""
    for node in nodes:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _statements(getattr(node, block, None) or [])


@functools.cache
def imports_of(source: str) -> list[Import]:
    """Every import of a bpsctl module in ``source``, at any depth (functions, methods,
    ``if`` blocks). ``from pkg import name`` names the submodule ``pkg.name`` when there is
    one, else ``pkg`` itself."""
    path = MODULES[source]
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in _statements(ast.parse(text).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(source, path.name == "__init__.py", node)
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES
                       else module for alias in node.names]
        else:
            continue
        statement = " ".join(" ".join(lines[node.lineno - 1:node.end_lineno]).split())
        for target in dict.fromkeys(targets):
            while target and target not in MODULES:     # `import a.b.c` of a non-module
                target = target.rpartition(".")[0]
            if target.split(".")[0] == "bpsctl" and target != source:
                found.append(Import(source, target, path, node.lineno, statement))
    return found


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (0 is the top): its longest listed prefix."""
    best, index = -1, -1
    for i, layer in enumerate(LAYERS):
        for name in layer:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, index = len(name), i
    assert index >= 0, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return index


def _layer_name(index: int) -> str:
    return " ".join(LAYERS[index])


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_allowed_entries_are_still_imports():
    found = {(i.source, i.target) for module in MODULES for i in imports_of(module)}
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"ALLOWED names imports that are gone: {stale}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{i.where()}\n    {i.source} ({_layer_name(layer_of(i.source))}) imports "
              f"{i.target} ({_layer_name(layer_of(i.target))}), a layer above it"
              for module in MODULES for i in imports_of(module)
              if layer_of(i.target) < layer_of(i.source) and (i.source, i.target) not in ALLOWED]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def _cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _loop_in(component: list[str], graph: dict[str, dict[str, Import]]) -> list[Import]:
    """One loop of imports through ``component``, from its first module back to it."""
    members, start = set(component), component[0]
    paths: dict[str, list[Import]] = {start: []}
    queue = [start]
    while queue:                        # breadth first: the shortest loop through start
        node = queue.pop(0)
        for nxt, edge in sorted(graph[node].items()):
            if nxt == start:
                return [*paths[node], edge]
            if nxt in members and nxt not in paths:
                paths[nxt] = [*paths[node], edge]
                queue.append(nxt)
    raise AssertionError(f"no loop through {start}")


def test_no_import_cycles():
    graph: dict[str, dict[str, Import]] = {module: {} for module in MODULES}
    for module in MODULES:
        for i in imports_of(module):
            if (i.source, i.target) not in ALLOWED:
                graph[module].setdefault(i.target, i)
    loops = ["\n".join(f"    {edge.where()}" for edge in _loop_in(component, graph))
             for component in _cycles(graph)]
    assert not loops, "import loops:\n" + "\n  and\n".join(loops)


def test_the_checks_name_the_module_and_line_of_an_offence(tmp_path):
    """The checks above read imports as written: a function-level import counts, and the
    offence names its file and line."""
    found = {(i.source, i.target, i.line) for i in imports_of("bpsctl.engine.torch.basics")}
    lazy = [line for source, target, line in found if target == "bpsctl.engine.torch.mpi_ops"]
    assert lazy, "the function-level import in basics.py was not found"
    line = MODULES["bpsctl.engine.torch.basics"].read_text().splitlines()[lazy[0] - 1]
    assert "from .mpi_ops import" in line
    assert layer_of("bpsctl.engine.torch.ops") == layer_of("bpsctl.engine")
    assert layer_of("bpsctl.tune.model") < layer_of("bpsctl.model")
    graph = {"a": {"b": Import("a", "b", PACKAGE / "a.py", 3, "import b")},
             "b": {"a": Import("b", "a", PACKAGE / "b.py", 7, "import a")}, "c": {}}
    assert _cycles(graph) == [["a", "b"]]
    assert [edge.where() for edge in _loop_in(["a", "b"], graph)] == \
        ["bpsctl/a.py:3: import b", "bpsctl/b.py:7: import a"]
