"""Every shape suffix in the code is made of the shape legend's letters (docs/design.md, "Shape
legend"), and the legend gives each letter one meaning. Read statically from every module's syntax:
a name like ``x_TD`` or ``offsets_E1`` (lower-case stem, an underscore, capital letters and digits)
is a shape suffix; ALL_CAPS constants are not."""

from __future__ import annotations

import ast
import re

from tests.support.paths import ROOT

SUFFIX = re.compile(r"^[a-z][a-z0-9_]*?_([A-Z][A-Z0-9]*)$")
FOLDERS = ("moe", "zero", "routing_kernels", "experiments", "tests")


def legend() -> dict[str, str]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Shape legend", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([A-Z]) \| (.+?) \|$", section, flags=re.M)
    letters = [letter for letter, _ in rows]
    assert len(letters) == len(set(letters)), f"a letter with two rows in the legend: {letters}"
    return dict(rows)


def suffix_names(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    return {n for n in names if SUFFIX.match(n)}


def unknown_letters(names, letters) -> dict[str, str]:
    out = {}
    for name in names:
        wrong = set(re.sub(r"\d", "", SUFFIX.match(name).group(1))) - set(letters)
        if wrong:
            out[name] = "".join(sorted(wrong))
    return out


def test_every_shape_suffix_is_in_the_legend():
    letters = legend()
    assert len(letters) >= 20  # the table was found
    bad = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, wrong in unknown_letters(suffix_names(path.read_text()), letters).items():
                bad.setdefault(name, (str(path.relative_to(ROOT)), wrong))
    assert not bad, f"shape suffixes with letters not in docs/design.md's legend (name: file, letters): {bad}"


def test_the_reader_sees_a_planted_suffix():
    src = "def f(x_TD, counts_E1):\n    y_TI = x_TD\n    MAX_LEN = 3\n    return self.w_EQD\n"
    assert suffix_names(src) == {"x_TD", "counts_E1", "y_TI", "w_EQD"}
    assert unknown_letters(suffix_names(src), legend()) == {"y_TI": "I"}
