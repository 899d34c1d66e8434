"""llmgw's tests, grouped by the app they test, on one harness (``tests/harness``).

Scenario codes in docstrings (L2, C1, N13, G6, U1, A2...) are those of ``docs/scenarios.md``,
which says which test covers which fault.
"""
