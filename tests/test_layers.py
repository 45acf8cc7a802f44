"""The layers a newcomer would draw hold (issue 42): `coordination/` at the bottom; `producers/` and
`trainer/` above it, neither importing the other; `app/` above them; `deploy/`, `benchmarks/` and the
test tooling (`cellfeed_testing/`) on top. Each package's imports are read (ast, every import in
every function too), and an import of a higher layer, or of a peer, fails with the file and line.
Inside `coordination/` its concerns stack the same way (`COORDINATION`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"coordination": 0, "producers": 1, "trainer": 1, "app": 2, "deploy": 3, "benchmarks": 3, "cellfeed_testing": 3}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in `path` that names one of the repository's packages."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in LAYER]
    return out


def violations(root: Path) -> list[str]:
    bad = []
    for package, level in LAYER.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, target in imports_of(path):
                if target == package:
                    continue
                if LAYER[target] > level or (LAYER[target] == level and level < 3):
                    what = "a higher layer" if LAYER[target] > level else "a peer"
                    bad.append(f"{path.relative_to(root)}:{line}: {package} imports {target} ({what})")
    return bad


def test_no_package_imports_a_higher_layer_or_a_peer():
    assert violations(ROOT) == []


# coordination/'s concerns stack, each on the ones above it here (docs/DESIGN.md, "Why coordination/ is
# one package"): a module imports from its own level or a lower one
COORDINATION = [
    "arrays errors feistel net seeds",  # helpers every concern uses
    "queues wire routing backends local_backend local_client modal_backend latency",  # the transport
    "summary audit vocab scalars",  # a run's facts, its audit and its scalars (TensorBoard)
    "plan corpus corpus_file balance driver",  # epochs: their plans, and the driver that issues their units
]


def coordination_violations(root: Path) -> list[str]:
    level = {name: k for k, names in enumerate(COORDINATION) for name in names.split()}
    bad = []
    for path in sorted((root / "coordination").glob("*.py")):
        if path.stem == "__init__":
            continue
        if path.stem not in level:
            bad.append(f"coordination/{path.name}: in no level of COORDINATION (which concern does it serve?)")
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "coordination" and len(parts) > 1 and level.get(parts[1], -1) > level[path.stem]:
                    bad.append(f"coordination/{path.name}:{node.lineno}: imports {name} (a later concern)")
    return bad


def test_coordination_concerns_stack():
    assert coordination_violations(ROOT) == []


def test_the_layer_check_finds_an_import_up(tmp_path):
    (tmp_path / "coordination").mkdir()
    (tmp_path / "coordination" / "x.py").write_text("def f():\n    from app.modal_app import app\n")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "y.py").write_text("import producers.tokenizers\n")
    assert violations(tmp_path) == [
        "coordination/x.py:2: coordination imports app (a higher layer)",
        "trainer/y.py:1: trainer imports producers (a peer)",
    ]


def test_no_repository_file_points_outside_it():
    """A user of the repository has only the repository: no file names the development machine's
    shared folder beside the checkout (its issues' checks and background papers)."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    marker = "../" + "sha" + "red"  # (this file names it once, split)
    found = [f for f in files if (ROOT / f).is_file() and marker in (ROOT / f).read_text(errors="replace")]
    assert found == []
