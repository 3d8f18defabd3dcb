"""Rules for the whole suite (tests/ and every plugin's tests).

CI runs the README's test command without the reference packages, then ``pytest -m
reference`` once they are installed: a test that skips for want of one of them must carry
the ``reference`` mark, or the second pass would never run it. Such a test fails here,
saying so.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any

import pytest

REFERENCE_PACKAGES = ("torch", "transformers", "mlx_lm", "accelerate")
_MISSING = re.compile("could not import '({})'".format("|".join(REFERENCE_PACKAGES)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]
                              ) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and call.excinfo is not None and "reference" not in item.keywords:
        found = _MISSING.search(str(call.excinfo.value))
        if found:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} skips without {found.group(1)} (a reference "
                               "package) but is not marked `reference`: CI's reference pass "
                               "would never run it")
