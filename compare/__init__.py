"""Comparing optimizers: a plan of trunk and cooldown-branch runs, their launch, and the report
(report.py, stats.py) built from what the runs wrote. docs/compare.md describes it."""
