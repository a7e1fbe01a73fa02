"""The pipeline tests' helpers (``stub_store``) are importable by module name."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
