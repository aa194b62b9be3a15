"""Training: the run config's schema (train/run_config.py)."""
