"""The runtime: solidloop's dramatiq actors (actors.py), the bodies of the two
turn actors (turns.py) and the entry module of worker processes (worker.py)."""
