"""The train tests reuse the engine tests' weight helpers (models A/B, oracles)."""

from __future__ import annotations

import sys
from pathlib import Path

_ENGINE_TESTS = str(Path(__file__).resolve().parents[1] / "engine")
if _ENGINE_TESTS not in sys.path:
    sys.path.insert(0, _ENGINE_TESTS)
