"""Makes ``protocol_testkit`` (shared fakes: trajectory factory, sample messages, fake clock, the
in-memory ``Net`` pump) importable from these tests under any pytest import mode."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
