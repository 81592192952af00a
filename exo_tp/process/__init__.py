"""Processes exo-tp starts: their lifetime and their supervision."""
