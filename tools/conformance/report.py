"""Printing results: one aligned line per check and a summary line, or one JSON document.

Text: ``PASS name`` (notes in parentheses), ``FAIL name: reason``; reasons and notes start in one
column so a long report scans easily; the last line is ``N passed, M failed in T s``. Lines are
printed as checks finish (``line``), the summary at the end. JSON carries the same plus timings
and per-check details, for CI and dashboards.
"""

from __future__ import annotations

import json
from typing import Any

from tools.conformance.registry import Result
from tools.conformance.runner import SuiteReport


def line(r: Result, width: int) -> str:
    if r.passed:
        return f"PASS {r.name:<{width + 1}} ({'; '.join(r.notes)})" if r.notes else f"PASS {r.name}"
    return f"FAIL {r.name + ':':<{width + 1}} {r.reason}"


def summary(report: SuiteReport) -> str:
    return f"{report.passed} passed, {report.failed} failed in {report.duration_s:.1f} s"


def as_dict(report: SuiteReport) -> dict[str, Any]:
    return {
        "role": report.role,
        "target": report.target,
        "address": report.address,
        "passed": report.passed,
        "failed": report.failed,
        "duration_s": report.duration_s,
        "checks": [
            {
                "name": r.name,
                "status": "PASS" if r.passed else "FAIL",
                "reason": r.reason,
                "notes": r.notes,
                "duration_s": r.duration_s,
                "details": r.details,
            }
            for r in report.results
        ],
    }


def as_json(report: SuiteReport) -> str:
    return json.dumps(as_dict(report), indent=2, default=str)
