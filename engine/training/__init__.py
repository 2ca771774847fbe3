"""Offline work, never on a serving path: ``specserve train-eagle3``'s data and training
(eagle3_data.py, eagle3.py) and the Medusa and self-speculation calibration (calibration.py)."""
