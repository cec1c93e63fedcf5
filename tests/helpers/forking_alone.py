"""trainjob/trainers/torch/forking.py loaded from its file, as ``forking``: nothing else of the
package comes in (no torch, and no handler installed by the package's import)."""

import importlib.util
from pathlib import Path

FILE = Path(__file__).resolve().parents[2] / "trainjob/trainers/torch/forking.py"
_spec = importlib.util.spec_from_file_location("forking", FILE)
forking = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forking)
