"""The errors of the host's jobs: the part of the tree under ``BrokerError``.

They live beside the broker because the broker raises the first two (an
encoder that rejects a message, a ``session=`` that cannot carry one); the
jobs layer above raises the rest. All derive from
:class:`~flask_solidloop.errors.BrokerError`, so ``except SolidLoopError``
still catches them::

    BrokerError
    └── JobError                 a host job could not be declared, sent or found
        ├── JobEncodeError       the message encoder rejected an argument (at send)
        ├── InvalidJobError      bad input: an option, a function, a queue name,
        │                        a session or a datetime that cannot work
        ├── JobImportError       the worker cannot import the job's function
        └── NoSuchJobError       no job with that id (``Job.fetch``, ``requeue``)

Each message names what was wrong and what to do instead.
"""

from __future__ import annotations

from ..errors import BrokerError


class JobError(BrokerError):
    """A host job could not be declared, sent, found or run."""


class JobEncodeError(JobError, TypeError):
    """The message encoder (``dramatiq.get_encoder()``) rejected a job's arguments."""


class InvalidJobError(JobError, ValueError):
    """A job, an actor or a queue was declared or sent with input that cannot work."""


class JobImportError(JobError, ImportError):
    """The worker could not import a job's function from its recorded path."""


class NoSuchJobError(JobError, LookupError):
    """No job has this id (it never existed, or the janitor pruned it)."""
