"""The layout `CONTRIBUTING.md` maps: eqfit's private modules in layers (`_core`, `_step`,
`_program`, `_keep`, `_host`, then the top level), each importing only its own layer and
those below, with no circle of imports, and none importing eqfit itself; the map names
every module; and no module or function is longer than one reads whole. Read from the
source (lazy and type-only imports count), nothing imported.
"""

import ast
import pathlib

import eqfit


ROOT = pathlib.Path(eqfit.__file__).parent
# From the bottom up: a module may import its own layer's modules and those below.
LAYERS = ("_core", "_step", "_program", "_keep", "_host")
TOP = len(LAYERS)  # `eqfit/*.py` and the public `models/`
# The house style's sizes: a module under this many lines, a function under this many
# lines of logic (`logic_lines`).
MODULE_LINES = 600
FUNCTION_LINES = 60


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


def test_no_module_imports_eqfit_itself():
    # From inside the package, an import of `eqfit` (or `__import__`, which hides one)
    # runs back up through `eqfit/__init__.py`: a module imports the modules it needs.
    known = modules()
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for name, path in known.items()
        for line, what in imports_of_eqfit(name, path, known)
    ]
    assert not found, "\n".join(found)


def test_an_import_of_eqfit_itself_is_seen(tmp_path):
    # The rule's own reading: each way a module could import the package it is in.
    path = tmp_path / "_x.py"
    path.write_text(
        "import eqfit\n"
        "from eqfit import fit\n"
        "from .. import fit\n"
        "from .. import losses\n"  # a module of eqfit's: no import of the package
        "folder = __import__('eqfit').__file__\n"
    )
    found = imports_of_eqfit("eqfit._step._x", path, modules())
    assert [line for line, _ in found] == [1, 2, 3, 5]


def test_no_module_is_longer_than_600_lines():
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in modules().values()
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES
    ]
    assert not long, "\n".join([f"modules over {MODULE_LINES} lines:", *long])


def test_no_function_has_more_than_60_lines_of_logic():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines of logic"
        for path in modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (lines := logic_lines(node)) > FUNCTION_LINES
    ]
    assert not long, "\n".join([f"functions over {FUNCTION_LINES} lines of logic:", *long])


def test_lines_of_logic_leave_out_the_docstring_comments_and_blank_lines():
    source = (
        "def f(x):\n"
        '    """Its docstring,\n    over two lines."""\n'
        "    # a comment\n"
        "\n"
        "    y = g(\n"
        "        x,\n"
        "    )\n"
        "    return y\n"
    )
    (function,) = ast.parse(source).body
    assert isinstance(function, ast.FunctionDef)
    assert logic_lines(function) == 3  # `y = g(`, `x,` and `return y`: `)` is no node's


def logic_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines of logic: the distinct lines on which its body's nodes begin
    (its nested functions' too), its docstring left out: comments, blank lines and a
    closing bracket's own line are no node's.
    """
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    lines = {n.lineno for statement in body for n in ast.walk(statement) if hasattr(n, "lineno")}
    return len(lines)


def imports_of_eqfit(
    name: str, path: pathlib.Path, known: dict[str, pathlib.Path]
) -> list[tuple[int, str]]:
    """Where module `name` imports the package `eqfit` itself (`import eqfit`, `from eqfit
    import ...`, or a relative import of a name of the package's own that is no module of
    it), or names `__import__`: each as its line and what it is.
    """
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] == "eqfit"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = base + (node.module.split(".") if node.module else [])
                into = [a.name for a in node.names if ".".join([*stem, a.name]) not in known]
                if stem == ["eqfit"] and into:
                    found.append((node.lineno, f"from {'.' * node.level} import {', '.join(into)}"))
            elif (node.module or "").split(".")[0] == "eqfit":
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Name) and node.id == "__import__":
            found.append((node.lineno, "__import__"))
    return sorted(set(found))
