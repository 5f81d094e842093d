"""Experiment tracking (TensorBoard, Weights & Biases) from the run ledger: names.py (the metric names),
series.py (the points, read from a ledger), the sinks, tracker.py (live, in the daemon) and export.py
(`gyre export`). Importing this package loads neither tensorboard nor wandb."""
