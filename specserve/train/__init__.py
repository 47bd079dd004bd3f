"""Drafter training (`specserve train-drafter`): data regeneration (data.py), losses (losses.py), the
trainer with checkpoints and calibration (trainer.py), acceptance and model card (report.py), and the
command that runs it all (run.py)."""
