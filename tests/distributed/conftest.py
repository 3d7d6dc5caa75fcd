"""Makes tests/helpers.py importable from this folder (and from the ranks it spawns, which
inherit sys.path)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
