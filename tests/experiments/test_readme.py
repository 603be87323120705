"""The README's commands run as written: every training command's overrides compose (torchrun's
too), every tool's subcommand exists, every benchmark module starts, and the quick ones run."""

import re
import shlex
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from tests.support.training import cfg_of

README = (ROOT / "README.md").read_text()


def _commands() -> list[list[str]]:
    """Every command line in the README's bash blocks (continuation lines joined, comments dropped)
    and every inline `python -m ...` in its text."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line))
    text = re.sub(r"```.*?```", "", README, flags=re.S)
    out += [shlex.split(span) for span in re.findall(r"`(python -m [^`]+)`", text)]
    return out


def _module_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of `python -m M ...` or `torchrun ... -m M ...`."""
    if "-m" not in argv:
        return None
    i = argv.index("-m")
    if argv[0] not in ("python", "torchrun") and not argv[0].endswith("torchrun"):
        return None
    return argv[i + 1], argv[i + 2 :]


COMMANDS = [c for c in (_module_args(a) for a in _commands()) if c is not None]


def test_the_readme_has_commands_of_every_kind():
    modules = {m for m, _ in COMMANDS}
    assert {"experiments.train", "experiments.checkpoint", "zero.memory"} <= modules, modules
    assert any(m.startswith("experiments.bench.") for m in modules), modules


@pytest.mark.parametrize(
    "args",
    [a for m, a in COMMANDS if m == "experiments.train" and "-m" not in a and "--cfg" not in a],
    ids=lambda a: " ".join(a)[:60],
)
def test_every_training_command_composes(args):
    cfg = cfg_of(*args)  # a renamed key or a removed choice fails here, naming it
    for a in args:
        key, _, value = a.partition("=")
        if "/" in key or "." not in key:  # a group choice (checked by composing) or a plain flag
            continue
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert str(node).lower() in (value.lower(), str(_as_number(value)).lower()), (key, node, value)


def _as_number(value: str):
    try:
        return float(value) if any(c in value for c in ".e") else int(value)
    except ValueError:
        return value


def _run(module: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.distributed
def test_every_checkpoint_subcommand_exists():
    subcommands = {a[0] for m, a in COMMANDS if m == "experiments.checkpoint"}
    assert subcommands >= {"verify", "consolidate", "export-hf"}
    for sub in sorted(subcommands):
        p = _run("experiments.checkpoint", [sub, "--help"])
        assert p.returncode == 0, (sub, p.stderr[-2000:])


@pytest.mark.distributed
def test_every_benchmark_module_starts():
    for module in sorted({m for m, _ in COMMANDS if m.startswith("experiments.bench.")}):
        p = _run(module, ["--help"])
        assert p.returncode == 0 and "usage" in p.stdout, (module, p.stderr[-2000:])


@pytest.mark.distributed
def test_the_quick_commands_run_as_written():
    for module, args in COMMANDS:
        if module == "zero.memory" or (module == "experiments.train" and "--cfg" in args):
            p = _run(module, args)
            assert p.returncode == 0 and p.stdout.strip(), (module, args, p.stderr[-2000:])
