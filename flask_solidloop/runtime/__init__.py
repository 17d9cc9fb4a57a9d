"""The runtime: solidloop's dramatiq actors (actors.py), the bodies of the two
turn actors (turns.py), the entry module of worker processes (worker.py), and
what a worker process starts and stops with it (llm_io.py, mcp_servers.py)."""
