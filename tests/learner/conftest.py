"""Makes ``process_testkit`` (starting, stopping and reading real learner processes) importable
from these tests under any pytest import mode."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
