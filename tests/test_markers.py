"""`-m "not distributed"` is the single-process suite: every test that starts another process (gloo
ranks through ``run_distributed``, torchrun agents, a fresh interpreter through ``subprocess``)
carries ``@pytest.mark.distributed``, directly or on its module. Read from the test files' syntax,
following the module's own helpers and fixtures, so a new test cannot forget the marker unseen."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# what starts a process: the ranks' spawner, subprocess's entry points, multiprocessing
STARTERS = {"run_distributed", "run_torchrun_nodes", "Popen", "check_output", "check_call"}
STARTER_ATTRS = {("subprocess", "run"), ("subprocess", "Popen"), ("subprocess", "check_output"), ("mp", "Process")}


def _is_marked(decorators) -> bool:
    return any("distributed" in ast.unparse(d) and "mark" in ast.unparse(d) for d in decorators)


def _starts_process(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id in STARTERS:
                return True
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in STARTER_ATTRS:
                return True
    return False


def unmarked_process_starters(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    module_marked = any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
        and "distributed" in ast.unparse(n.value)
        for n in tree.body
    )
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    memo: dict[str, bool] = {}

    def starts(name: str, seen: frozenset = frozenset()) -> bool:
        if name in memo:
            return memo[name]
        fn = funcs.get(name)
        if fn is None or name in seen:
            return False
        used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {a.arg for a in fn.args.args}
        memo[name] = _starts_process(fn) or any(starts(u, seen | {name}) for u in used if u in funcs and u != name)
        return memo[name]

    if module_marked:
        return []
    return [n for n, fn in funcs.items() if n.startswith("test_") and starts(n) and not _is_marked(fn.decorator_list)]


def test_every_test_that_starts_a_process_is_marked_distributed():
    missing = {
        str(p.relative_to(TESTS)): names
        for p in sorted(TESTS.rglob("test_*.py"))
        if (names := unmarked_process_starters(p))
    }
    assert not missing, f"mark these @pytest.mark.distributed (they start processes): {missing}"


def test_the_check_sees_a_helper_a_fixture_and_a_subprocess(tmp_path):
    f = tmp_path / "test_planted.py"
    f.write_text(
        "import subprocess\nimport pytest\n"
        "def _spawn():\n    return run_distributed(print, 2)\n"
        "@pytest.fixture\ndef ranks():\n    return _spawn()\n"
        "def test_via_fixture(ranks):\n    pass\n"
        "def test_via_subprocess():\n    subprocess.run(['true'])\n"
        "@pytest.mark.distributed\ndef test_marked():\n    _spawn()\n"
        "def test_plain():\n    assert 1\n"
    )
    assert sorted(unmarked_process_starters(f)) == ["test_via_fixture", "test_via_subprocess"]
