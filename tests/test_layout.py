"""The layout `CONTRIBUTING.md` maps: eqfit's private modules in layers (`_core`, `_step`,
`_program`, `_keep`, `_host`, then the top level), each importing only its own layer and
those below, with no circle of imports; and the map names every module. Read from the
source (lazy and type-only imports count), nothing imported.
"""

import ast
import pathlib

import eqfit


ROOT = pathlib.Path(eqfit.__file__).parent
# From the bottom up: a module may import its own layer's modules and those below.
LAYERS = ("_core", "_step", "_program", "_keep", "_host")
TOP = len(LAYERS)  # `eqfit/*.py` and the public `models/`


def modules() -> dict[str, pathlib.Path]:
    """Every module of eqfit, by its dotted name (a package by its `__init__`)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("eqfit", *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The eqfit modules that module `name` imports, anywhere in it."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = base + (node.module.split(".") if node.module else [])
            else:
                stem = (node.module or "").split(".")
            for target in [stem] + [stem + [a.name] for a in node.names]:
                dotted = ".".join(target)
                if dotted in known and dotted != name and dotted != "eqfit":
                    found.add(dotted)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known and a.name != "eqfit"}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_imports_a_layer_above_its_own():
    above = [
        f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
        for name, targets in graph().items()
        for target in sorted(targets)
        if layer(target) > layer(name)
    ]
    assert not above, "\n".join(above)


def test_no_modules_import_each_other_in_a_circle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [node, nxt]))
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert not circles, "\n".join(circles)


def test_the_map_names_every_module():
    text = (ROOT.parent / "CONTRIBUTING.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for path in modules().values()
        if path.name != "__init__.py" and f"`{path.relative_to(ROOT)}`" not in text
    ]
    assert not missing, f"CONTRIBUTING.md's map misses {missing}"


def test_an_import_from_a_layer_above_is_seen(tmp_path):
    # The rule's own reading, on a module of `_step` that imports the drive, lazily.
    path = tmp_path / "_x.py"
    path.write_text("def f():\n    from .._host._drive import Drive\n    return Drive\n")
    targets = imports("eqfit._step._x", path, modules() | {"eqfit._step._x": path})
    assert targets == {"eqfit._host._drive"}
    assert layer("eqfit._host._drive") > layer("eqfit._step._x")
