"""The docs name code that exists: every code name README.md and docs/*.md cite in backticks
resolves in the product packages (parsed with `ast`, nothing imported), by the rules of the
project's acceptance check (`house`):

- `path/file.py:name` or `file.py:Class.member`: the file exists, and when it is a product file it
  defines `name` at top level (a function, class or assigned name), or `Class` with `member` (a
  method, nested class or class attribute). A bare `file.py` that is no path from the root (a short
  name after the first mention) is the product file of that basename, when only one has it.
- `Class.member`, where `Class` is a class some product module defines at top level: one such
  class has `member`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("app", "producers", "trainer", "coordination")
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
MIN_REFS = 20  # the docs cite more (28 today, 14 in the README's journey): fewer means the scan broke


def product_trees() -> dict[Path, ast.Module]:
    """Each product file (relative to the root) parsed."""
    return {p.relative_to(ROOT): ast.parse(p.read_text(), str(p)) for d in PRODUCT for p in (ROOT / d).rglob("*.py")}


def members(cls: ast.ClassDef) -> set[str]:
    out = set()
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return out


def top(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, ast.Assign):
            out |= {t.id: n for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out[n.target.id] = n
    return out


def resolves(tree: ast.Module, dotted: str) -> bool:
    """`name` at top level, or `Class.member` (a deeper path is judged by its first two parts)."""
    parts = dotted.split(".")
    names = top(tree)
    if parts[0] not in names:
        return False
    if len(parts) == 1:
        return True
    node = names[parts[0]]
    return isinstance(node, ast.ClassDef) and parts[1] in members(node)


def check_docs(docs: list[Path]) -> tuple[list[str], int]:
    """(each reference in `docs` that does not resolve, as `doc: `code`: why`; how many references
    were checked)."""
    trees = product_trees()
    classes: dict[str, list[ast.ClassDef]] = {}
    for tree in trees.values():
        for n in tree.body:
            if isinstance(n, ast.ClassDef):
                classes.setdefault(n.name, []).append(n)
    bad, n_refs = [], 0
    for doc in docs:
        name = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name
        for code in re.findall(r"`([^`\n]+)`", doc.read_text()):
            code = code.strip().rstrip("()")
            m = re.fullmatch(r"([\w/]+\.py):([\w.]+)", code)
            if m:
                n_refs += 1
                f = Path(m.group(1))
                if not (ROOT / f).exists() and "/" not in m.group(1):  # a short name: a unique basename
                    same = [p for p in trees if p.name == f.name]
                    f = same[0] if len(same) == 1 else f
                if not (ROOT / f).exists():
                    bad.append(f"{name}: `{code}`: no file {f}")
                elif f in trees and not resolves(trees[f], m.group(2)):
                    bad.append(f"{name}: `{code}`: no {m.group(2)} in {f}")
                continue
            m = re.fullmatch(r"([A-Z]\w+)\.(_?[a-z]\w*)", code)
            if m and m.group(1) in classes:
                n_refs += 1
                if not any(m.group(2) in members(c) for c in classes[m.group(1)]):
                    bad.append(f"{name}: `{code}`: class {m.group(1)} has no {m.group(2)}")
    return bad, n_refs


def test_every_code_name_the_docs_cite_resolves():
    bad, n_refs = check_docs(DOCS)
    assert n_refs >= MIN_REFS, f"only {n_refs} code names found in {[d.name for d in DOCS]}: is the scan broken?"
    assert not bad, f"{len(bad)} code names in the docs do not resolve:\n" + "\n".join(bad)


def test_the_check_finds_each_kind_of_name_that_does_not_resolve(tmp_path):
    """So that the test above cannot pass by matching nothing."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "`producers/dataset.py:open_dataset` `producers/dataset.py:Dataset.read_rows`\n"
        "`dataset.py:RowBlock` `Dataset.verify()` `producers/dataset.py:no_such`\n"
        "`producers/dataset.py:Dataset.nope` `producers/missing.py:x` `Dataset.nope`\n"
        "`NotAClass.anything` `plain words` `dataset.py`\n"
    )
    bad, n_refs = check_docs([doc])
    assert n_refs == 8
    assert bad == [
        "doc.md: `producers/dataset.py:no_such`: no no_such in producers/dataset.py",
        "doc.md: `producers/dataset.py:Dataset.nope`: no Dataset.nope in producers/dataset.py",
        "doc.md: `producers/missing.py:x`: no file producers/missing.py",
        "doc.md: `Dataset.nope`: class Dataset has no nope",
    ]
