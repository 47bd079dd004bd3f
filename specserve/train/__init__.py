"""Drafter training (`specserve train-drafter`): data regeneration (data.py), losses (losses.py), and the
loop with calibration and export (train_drafter.py)."""
