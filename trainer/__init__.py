"""The train step and what runs around it: the jitted step (step.py), the metrics it
computes (step_metrics.py, aux_state.py), the host loop's hooks (hooks.py) and the FLOP/s peak
that MFU divides by (flops.py).
"""
