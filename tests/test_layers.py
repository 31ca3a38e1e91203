"""The library's layers, bottom to top: codec (the wire format) and geometry (the transforms), then
reduce (how bytes travel and are summed), core (a model's state and step), then the frontends
(ddp, fsdp, hvd, over torch_comm or Horovod). A layer imports only those below it, and only the
Horovod frontend imports horovod (a torch-only install runs the rest); integrations, the trainers'
glue, sits on the torch frontends."""
import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "horovod_gift"
SHARED = {"config", "telemetry", "kernels"}     # top-level modules every layer may read
BELOW_FRONTENDS = {"codec", "geometry", "reduce", "core", "torch_comm"}
ALLOWED = {
    # the user's options and the names they accept; the codec's own names are the codec's
    "config": {"codec", "kernels"},
    "codec": {"kernels"},
    "geometry": {"config", "codec"},
    "reduce": {"config", "telemetry", "codec"},
    "core": SHARED | {"codec", "geometry", "reduce"},
    "torch_comm": SHARED | {"reduce"},
    "ddp": SHARED | BELOW_FRONTENDS,
    "fsdp": SHARED | BELOW_FRONTENDS,
    "hvd": SHARED | {"codec", "geometry", "reduce", "core"},
    # the trainers' glue, over the torch frontends (never Horovod's)
    "integrations": SHARED | BELOW_FRONTENDS | {"ddp", "fsdp"},
}


def imports_of(path):
    """(first part of every horovod_gift module path the file imports, whether it imports
    horovod), nested imports included."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    found, horovod = set(), False
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(parts[:-1])[:len(parts) - node.level]
            found.add((base + (node.module or "").split("."))[0])
        elif isinstance(node, ast.ImportFrom) and node.module.startswith("horovod_gift."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom):
            horovod |= node.module.split(".")[0] == "horovod"
        elif isinstance(node, ast.Import):
            horovod |= any(a.name.split(".")[0] == "horovod" for a in node.names)
    return found, horovod


def layer_files(layer):
    folder = PACKAGE / layer
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{layer}.py"]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_those_below_it(layer):
    for path in layer_files(layer):
        found, horovod = imports_of(path)
        above = found - ALLOWED[layer] - {layer}
        assert not above, f"{path.relative_to(PACKAGE)} imports {sorted(above)} of a layer above"
        assert not horovod or layer == "hvd", f"{path.relative_to(PACKAGE)} imports horovod"


def module_graph():
    """Every module of horovod_gift (its dotted name) -> the horovod_gift modules it imports,
    those inside functions included (a circle is one whichever import runs first)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        name = ".".join(p for p in parts if p != "__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = (package if parts[-1] != "__init__" else parts[:-1])
                base = base[:len(base) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
                if node.module is None:     # from . import a, b
                    found |= {".".join(target + [a.name]) for a in node.names}
                else:
                    found.add(".".join(target))
            elif isinstance(node, ast.ImportFrom) and node.module.startswith("horovod_gift."):
                found.add(node.module[len("horovod_gift."):])
        modules[name] = found
    known = set(modules)
    return {m: {t for t in targets if t in known and t != m} for m, targets in modules.items()}


def test_no_circle_among_the_modules():
    graph = module_graph()
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert "config" in graph and "codec.backend" in graph["config"], graph.get("config")


def test_every_module_belongs_to_a_layer():
    top = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir()
                                                     if (p / "__init__.py").exists()}
    assert top - set(ALLOWED) - {"__init__"} <= SHARED, sorted(top)


def test_the_library_imports_no_trainer_it_is_not_asked_for():
    """The trainers are optional extras: the library and integrations.engines import none."""
    code = ("import sys, horovod_gift, horovod_gift.integrations.engines; "
            "print(sorted({'lightning', 'accelerate', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_step_core_is_split_by_concern_into_classes_under_15_methods():
    """GiftCore (the step's life and checkpoints), its BucketReducer (buckets, reductions,
    residuals), GiftStateBase (what every kind shares) and FsdpGiftState (its row reductions in
    fsdp/rows.py): each under 15 methods of its own (issue 56: GiftCore had 32, GiftStateBase
    20, FsdpGiftState 18)."""
    sizes = {}
    for path in ("core/gift_core.py", "core/reducer.py", "core/state_base.py", "fsdp/state.py"):
        tree = ast.parse((PACKAGE / path).read_text())
        sizes.update({node.name: sum(isinstance(item, ast.FunctionDef) for item in node.body)
                      for node in tree.body if isinstance(node, ast.ClassDef)})
    assert {"GiftCore", "BucketReducer", "GiftStateBase", "FsdpGiftState"} <= sizes.keys()
    assert all(count < 15 for count in sizes.values()), sizes
