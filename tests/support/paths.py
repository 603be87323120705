"""Where the repository lies, for tests that run its files or its configs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
