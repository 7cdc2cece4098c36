"""The floors of the package, read from the source with `ast` (every import, inside
functions too): each part imports only parts below it, the simulator and the runtime stand
side by side, and the simulator never imports what starts processes. See
docs/architecture.md."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "piper_nb"

# part -> floor; a part may import parts on lower floors only (leaves: anyone may)
FLOORS = {
    "errors": 0, "host": 0, "trace": 0, "optim": 0, "models": 0, "metrics": 0, "extras": 0,
    "ir": 1,
    "capture": 2,
    "directives": 3,
    "schedules": 4,
    "plan": 5,                       # the values the runtime and the simulator read
    "tp": 6,                         # one home: directive, rewrite, passes, widening
    "cp": 7,                         # context parallelism: cuts regions into parts as tp does
    "compiler": 8,
    "viz": 9,
    "sim": 10, "runtime": 10,        # side by side: neither imports the other
    "profile": 11,                   # measures by running the runtime, feeds the simulator
    "cluster": 12, "strategies": 12,
    "planner": 12,                   # compiles and prices (profiled: runs workers) many plans
    "train": 13,                     # local workers by default: above the clusters
    "ui": 14,
    "__init__": 15,                  # the public face
    "search_cli": 16,                # the command line uses the public face
    "launch_cli": 16,
    "__main__": 17,
}


def _part(module: str) -> str | None:
    bits = module.split(".")
    if bits[0] != "piper_nb":
        return None
    return bits[1] if len(bits) > 1 else "__init__"


def imports() -> dict[str, set[tuple[str, str]]]:
    """part -> {(imported part, file)} for every import in the package."""
    out: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts)
        me = _part(module.removesuffix(".__init__") if path.name == "__init__.py" else module)
        package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module[:-9]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = ([f"{base}.{a.name}" for a in node.names] if base == "piper_nb"
                         else [base])
            for name in names:
                part = _part(name)
                if part and part != me:
                    out[me].add((part, str(path.relative_to(PACKAGE.parent))))
    return out


def test_every_part_has_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert parts <= set(FLOORS), f"give these a floor: {sorted(parts - set(FLOORS))}"


def test_parts_import_only_the_floors_below():
    wrong = sorted(f"{path}: {part} imports {dep}" for part, deps in imports().items()
                   for dep, path in deps
                   if FLOORS[dep] > 0 and FLOORS[dep] >= FLOORS[part])
    assert wrong == []


def file_imports() -> dict[str, set[str]]:
    """module -> the modules of the package it imports (every import, inside functions too);
    `from piper_nb.x import y` names module `piper_nb.x.y` when that is a module, else
    `piper_nb.x`."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        modules[name] = path
    out: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    out[name].add(target)
    return out


def test_runtime_and_sim_import_nothing_from_the_compiler():
    """They read plans (`piper_nb.plan`), never the compiler that makes them."""
    wrong = sorted(f"{path}: {part} imports compiler" for part, deps in imports().items()
                   for dep, path in deps if part in ("runtime", "sim") and dep == "compiler")
    assert wrong == []


def test_no_cycle_between_files():
    """No circle at any level: inside a part too, module by module. A package's
    `__init__` re-exporting its modules is not a circle when nothing imports it back."""
    graph = file_imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                loop = path[path.index(dep):] if dep in path else []
                cycles.append(" -> ".join([*loop, node, dep]))
            elif dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert cycles == [], "cycles:\n" + "\n".join(cycles)


def test_the_simulator_never_starts_a_process():
    deps = {dep for dep, _ in imports()["sim"]}
    assert not deps & {"runtime", "cluster", "profile", "train", "ui"}
    for path in (PACKAGE / "sim").rglob("*.py"):
        text = path.read_text()
        for word in ("subprocess", "multiprocessing", "torch.distributed"):
            assert word not in text, f"{path.name} mentions {word}"


def test_no_cycle_between_parts():
    graph = {part: {dep for dep, _ in deps} for part, deps in imports().items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            assert state.get(dep) != 1, "cycle: " + " -> ".join([*path, node, dep])
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for part in graph:
        if part not in state:
            visit(part, [])


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_small():
    """No module over 400 lines, no function (or method) over 80: split along a seam."""
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(PACKAGE.parent))
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines (module)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{name}:{node.lineno} {node.name}: {length} lines (function)")
    assert big == [], "over the size limits:\n" + "\n".join(big)


def test_every_module_says_its_job_and_is_on_the_map():
    """Every module opens with a docstring, and docs/architecture.md's module map lists it."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing_doc, unlisted = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip():
            missing_doc.append(rel)
        if f"`{rel}`" not in doc:
            unlisted.append(rel)
    assert missing_doc == [], f"modules without an opening docstring: {missing_doc}"
    assert unlisted == [], f"add these to docs/architecture.md's module map: {unlisted}"


def test_the_compile_tests_no_directive_type_and_imports_nothing_inside_a_function():
    """`pn.compile` reads as its phases (`compiler.passes`): what a directive kind means is
    read by the passes and helpers of its own module, never by an `isinstance` in
    `compiler/compile.py`; and `train/` asks the compiler from the top of its modules, not
    from inside a function (where a second copy of compile work once hid)."""
    from piper_nb.directives.spec import REGISTRY

    kinds = {cls.__name__ for cls in REGISTRY.values()} | {"Directive"}
    tree = ast.parse((PACKAGE / "compiler" / "compile.py").read_text())
    tested = [ast.unparse(n) for n in ast.walk(tree)
              if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance"
              and {getattr(x, "id", None) for x in ast.walk(n.args[1])} & kinds]
    assert tested == [], f"compiler/compile.py tests directive types: {tested}"
    inner = []
    for path in (PACKAGE / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner += [f"{path.name}:{n.lineno}" for n in ast.walk(node)
                          if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(
                              "piper_nb.")]
    assert inner == [], f"piper_nb imported inside train/ functions: {inner}"


def test_tensor_parallelism_has_one_home():
    """Tensor parallelism lives in `piper_nb/tp/` (the directive, the module
    rewrite, its passes in each phase, the widening): no module elsewhere is named for it,
    every other part reads it through the package's face, never its inner modules, and
    nothing reads its plan fields by duck typing."""
    home = PACKAGE / "tensor_parallel"
    stray = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if home not in p.parents and (p.stem.startswith("tp_") or "tensor_parallel" in p.stem)]
    assert stray == [], f"tensor-parallel modules outside piper_nb/tp/: {stray}"
    inner = sorted(f"{name} imports {dep}" for name, deps in file_imports().items()
                   for dep in deps if dep.startswith("piper_nb.tp.")
                   and not name.startswith("piper_nb.tp"))
    assert inner == [], f"read piper_nb.tp, not its modules: {inner}"
    duck = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if 'getattr(plan, "tp_' in p.read_text()]
    assert duck == [], f"typed fields, not getattr: {duck}"
