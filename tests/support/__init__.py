"""What the tests run, none of it a test: the helper apps (support_app, admin_app,
jobs_app, mcp_server_app) with their agents and tools, the modules and servers
worker and gunicorn subprocesses load (jobs_tasks, mcp_gunicorn), and the harnesses
(chaos, sdk_contract). pytest collects nothing here: no module is named test_*.py."""
