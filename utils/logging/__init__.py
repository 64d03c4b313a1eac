"""What a run tells: one-line messages (messages.py: say, warn) and the sinks that
record metrics (sinks/: console, metrics.jsonl, TensorBoard, wandb).
"""
