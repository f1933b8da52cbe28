"""Makes ``conformance_testkit`` (endpoints in background threads, broken protocol variants, CLI
helpers) importable from these tests under any pytest import mode."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
