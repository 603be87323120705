"""Where the repository lies, for tests that run its files or its configs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
# conf/ folders that are not config groups of train.yaml: the planner's machine profiles
# (python -m experiments.plan plan.cluster=<name>, zero.plan.load_profile)
NOT_GROUPS = frozenset({"cluster"})
