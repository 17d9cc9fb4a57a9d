"""The transactional job queue: a dramatiq broker over PostgreSQL (broker.py),
its statements (sql.py), enqueue helpers for solidloop's own actors
(dispatch.py), the current job of a worker thread (current_job.py), a dramatiq
Results backend on PostgreSQL (results.py), the errors of host jobs
(errors.py) and the worker middleware (middleware/, one per file)."""
