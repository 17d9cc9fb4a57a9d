"""Loop state: its statements (sql.py, each named once), the store (store/: every
write of loop, message, tool-call, MCP-session and event rows and their
successor jobs), the queries (every read), the host commands' facade
(control.py) and what makes text storable (storable.py)."""
