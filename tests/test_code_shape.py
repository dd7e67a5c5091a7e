"""The shape STYLE.md asks of the code outside tests (issue 21, acceptance 2).

Read statically with `ast` (nothing is imported), over every non-test module of the
project (`bus_schemas/`, `router/`, `services/`, `gpu_worker/`, `benchmarks/`, `scripts/`):
- no module over `MAX_MODULE_LINES` lines (kernels and flag parsing included: each stays
  under it by being split, not by an exception list);
- no class over `MAX_METHODS` methods (every `def` in its body, properties included) unless
  its docstring says why it must be one class, in a sentence with the words "one class".
Each test can fail: the last two plant an offending module and class and see them caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("bus_schemas", "router", "services", "gpu_worker", "benchmarks", "scripts")
MAX_MODULE_LINES = 500
MAX_METHODS = 20
REASON = "one class"


def modules(root: Path = ROOT) -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (root / folder).rglob("*.py"))


def long_modules(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {lines}")
    return out


def big_classes(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            defs = (ast.FunctionDef, ast.AsyncFunctionDef)
            methods = sum(isinstance(b, defs) for b in node.body)
            if methods > MAX_METHODS and REASON not in (ast.get_docstring(node) or ""):
                out.append(f"{path.name}: {node.name} has {methods} methods")
    return out


def test_the_walk_finds_the_packages() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in modules()}
    assert {"gpu_worker/cache/radix.py", "router/app.py", "services/cli.py"} <= names


def test_no_module_over_the_line_limit() -> None:
    assert long_modules(modules()) == []


def test_no_class_over_the_method_limit_without_a_reason() -> None:
    assert big_classes(modules()) == []


def test_an_offending_module_and_class_are_caught(tmp_path: Path) -> None:
    methods = "".join(f"    def m{i}(self) -> None: ...\n" for i in range(MAX_METHODS + 1))
    big = tmp_path / "big.py"
    big.write_text(f"class Big:\n    '''Many verbs.'''\n{methods}" + "\n" * MAX_MODULE_LINES)
    assert long_modules([big]) == [f"{big}: {MAX_MODULE_LINES + 2 + MAX_METHODS + 1}"]
    assert big_classes([big]) == [f"big.py: Big has {MAX_METHODS + 1} methods"]


@pytest.mark.parametrize("doc, caught", [("Many verbs.", True), ("It must be one class.", False)])
def test_a_reason_in_the_docstring_lets_a_class_stay_whole(
    tmp_path: Path, doc: str, caught: bool
) -> None:
    methods = "".join(f"    def m{i}(self) -> None: ...\n" for i in range(MAX_METHODS + 1))
    path = tmp_path / "whole.py"
    path.write_text(f"class Whole:\n    '''{doc}'''\n{methods}")
    assert bool(big_classes([path])) is caught
