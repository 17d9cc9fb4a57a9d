"""The shared LISTEN connection (decision 0014), on the real database.

One listener per broker and process: its consumers LISTEN on nothing
themselves, a notification wakes only the consumers of its queue, a killed
listener connection comes back and LISTENs again, and no wake-up is lost,
neither between a consumer's empty claim and its wait nor while the listener
is down. Each wake-up test sets the poll interval to an hour, so a consumer
that returns at all was woken by a notification (or by a delayed job's ETA),
never by its timed poll.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import dramatiq

from flask_solidloop.config import QUEUE_LLM, QUEUE_MAINTENANCE, QUEUE_TOOL
from flask_solidloop.loops.sql import WATCH_CHANNEL
from flask_solidloop.queue.listener import LISTENER_APPLICATION_NAME
from flask_solidloop.queue.sql import CHANNEL_PREFIX
from flask_solidloop.urls import libpq_url

HOUR = 3600.0
#: Guards against a hung suite; never a speed check (the machine may be loaded).
GUARD = 60.0


@contextlib.contextmanager
def consuming(broker, queue=QUEUE_MAINTENANCE, *, prefetch=1, timeout=HOUR * 1000):
    consumer = broker.consume(queue, prefetch=prefetch, timeout=int(timeout))
    try:
        yield consumer
    finally:
        consumer.close()


class Next:
    """``next(consumer)`` on a thread of its own; ``result`` once it returns."""

    def __init__(self, consumer):
        self.consumer = consumer
        self.result: list = []
        self.thread = threading.Thread(target=lambda: self.result.append(next(consumer)),
                                       daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(GUARD)
        assert not self.thread.is_alive(), "the consumer was never woken"
        return self.result[0]


def send_job(state, *, delay=None):
    message = state.actors["maintenance"].message("recover_jobs")
    state.broker.enqueue(message, delay=delay)
    rows = state.broker._run("SELECT id FROM solidloop_jobs WHERE message_id = %s",
                             (message.message_id,))
    return rows[0][0]


def listener_backends(pg):
    return [row[0] for row in pg.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
        "AND datname = current_database()", (LISTENER_APPLICATION_NAME,))]


def wait_until(predicate, what):
    deadline = time.monotonic() + GUARD
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def consumer_backends(pg):
    return pg.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                      "'solidloop-consumer' AND datname = current_database()").fetchone()[0]


# -- one LISTEN backend per broker and process ------------------------------------------


def test_consumers_of_three_queues_share_one_listen_backend(app, broker, pg):
    queues = (QUEUE_LLM, QUEUE_TOOL, QUEUE_MAINTENANCE)
    with contextlib.ExitStack() as stack:
        consumers = [stack.enter_context(consuming(broker, q)) for q in queues]
        listener = broker.listener
        assert all(c.listener is listener for c in consumers)
        # PostgreSQL's own view of the listener's session (pg_listening_channels()
        # run on it): every queue's channel, its control channel, and the
        # channel of watchers' arrivals (decision 0031), on the same backend.
        assert listener.listening() == {CHANNEL_PREFIX + q for q in queues} | {
            listener.control_channel, WATCH_CHANNEL}
        # The consumers claim through the broker's pool, whose connections
        # listen on nothing, and hold no connection of their own.
        assert broker._run("SELECT pg_listening_channels()") == []
        assert consumer_backends(pg) == 0
        # Exactly one listener backend on this database (earlier tests' listeners
        # close their connections when their last consumer leaves).
        wait_until(lambda: listener_backends(pg) == [listener.backend_pid],
                   "one listener backend, this broker's")


def test_a_real_worker_uses_one_listen_backend_for_all_its_queues(app, state, broker, pg):
    broker.poll_interval = HOUR
    worker = dramatiq.Worker(broker, worker_threads=2)
    worker.start()
    try:
        wait_until(lambda: all(t.consumer is not None for t in worker.consumers.values()),
                   "every consumer thread has its consumer")
        consumers = [t.consumer for t in worker.consumers.values()]
        assert {c.queue_name for c in consumers} >= {QUEUE_LLM, QUEUE_TOOL, QUEUE_MAINTENANCE}
        listener = broker.listener
        wait_until(lambda: listener.listening() >= {CHANNEL_PREFIX + c.queue_name
                                                    for c in consumers},
                   "the listener LISTENs on every consumed queue")
        wait_until(lambda: listener_backends(pg) == [listener.backend_pid],
                   "one listener backend")
        assert consumer_backends(pg) == 0  # they claim through the broker's pool
        job_id = send_job(state)  # the poll is an hour away: only the NOTIFY runs it
        wait_until(lambda: pg.execute("SELECT state FROM solidloop_jobs WHERE id = %s",
                                      (job_id,)).fetchone()[0] == "done", "the job ran")
    finally:
        worker.stop(timeout=10_000)
    # Every consumer left: the listener closed its connection.
    wait_until(lambda: listener_backends(pg) == [], "the listener backend closed")


# -- wake-ups go to the queue that has work ----------------------------------------------


def test_a_notify_on_one_queue_wakes_its_consumer_and_not_the_others(app, broker, pg):
    broker.poll_interval = HOUR
    with consuming(broker, QUEUE_MAINTENANCE) as x, consuming(broker, QUEUE_TOOL) as y:
        listener = broker.listener
        y_generation = listener.generation(QUEUE_TOOL)
        on_x, on_y = Next(x), Next(y)
        wait_until(lambda: x.claims == 1 and y.claims == 1, "both made their first claim")
        # A bare NOTIFY on X's channel: no job, so X wakes, claims nothing, returns None.
        pg.execute("SELECT pg_notify(%s, '')", (CHANNEL_PREFIX + QUEUE_MAINTENANCE,))
        assert on_x.join() is None
        assert (x.wakeups, x.claims) == (1, 2)
        # Y was never woken and never claimed again: its generation did not move.
        assert listener.generation(QUEUE_TOOL) == y_generation
        assert (y.wakeups, y.claims) == (0, 1)
        assert on_y.thread.is_alive()
        # ...and it was really waiting: its own queue's NOTIFY wakes it.
        pg.execute("SELECT pg_notify(%s, '')", (CHANNEL_PREFIX + QUEUE_TOOL,))
        assert on_y.join() is None
        assert (y.wakeups, y.claims) == (1, 2)


def test_no_wake_up_is_lost_between_an_empty_claim_and_the_wait(app, state, broker):
    # 200 jobs, each sent a random 0-3 ms after the previous one was received, so
    # the commits land all over the consumer's cycle (claiming, about to wait,
    # waiting), and each one is the last: with the poll an hour away, a wake-up
    # lost between an empty claim and the wait leaves that job unclaimed.
    broker.poll_interval = HOUR
    jobs = 200
    received: list[int] = []
    arrived = threading.Condition()
    with consuming(broker) as consumer:
        def consume():
            while len(received) < jobs:
                message = next(consumer)
                if message is not None:
                    consumer.ack(message)
                    with arrived:
                        received.append(message.job_id)
                        arrived.notify_all()

        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        sent = []
        for i in range(jobs):
            time.sleep(random.uniform(0, 0.003))
            sent.append(send_job(state))
            with arrived:
                assert arrived.wait_for(lambda i=i: len(received) > i, GUARD), (
                    f"job {i + 1} of {jobs} was never claimed: its wake-up was lost")
        thread.join(GUARD)
    assert received == sent


def test_a_delayed_job_is_claimed_when_due_by_a_consumer_that_polls_hourly(app, state, broker,
                                                                         pg):
    broker.poll_interval = broker.idle_poll_interval = HOUR
    with consuming(broker) as consumer:
        waiting = Next(consumer)
        wait_until(lambda: consumer.claims >= 1, "the consumer looked at its empty queue")
        # Its next look is an hour away: the delayed insert's NOTIFY tells it
        # the new due time, and it claims the job then, not before.
        job_id = send_job(state, delay=1500)
        message = waiting.join()
        assert consumer.wakeups == 1
        if message is None:  # woken early, it found nothing due: it waits for the due time
            message = Next(consumer).join()
        assert message is not None and message.job_id == job_id
        assert consumer.wakeups == 1  # the due time ended the last wait, not a notification
        eta, started_at = pg.execute("SELECT eta, started_at FROM solidloop_jobs "
                                     "WHERE id = %s", (job_id,)).fetchone()
        assert started_at >= eta  # never claimed before it was due
        consumer.ack(message)


# -- connection loss ----------------------------------------------------------------------


def test_a_killed_listener_connection_is_reestablished_and_listens_again(app, state, broker, pg):
    broker.poll_interval = HOUR
    with consuming(broker) as consumer:
        listener = broker.listener
        old_pid, connects = listener.backend_pid, listener.connects
        assert old_pid is not None
        assert pg.execute("SELECT pg_terminate_backend(%s)", (old_pid,)).fetchone()[0]
        assert listener.wait_connected(GUARD, after=connects)
        assert listener.backend_pid not in (None, old_pid)
        assert CHANNEL_PREFIX + QUEUE_MAINTENANCE in listener.listening()
        wait_until(lambda: listener_backends(pg) == [listener.backend_pid],
                   "one listener backend, the new one")
        waiting = Next(consumer)
        job_id = send_job(state)  # woken through the new connection, or never
        message = waiting.join()
        assert message is not None and message.job_id == job_id
        consumer.ack(message)


def test_consumers_poll_while_the_listener_is_down_and_no_job_is_lost(app, state, broker, pg,
                                                                       database_url):
    with consuming(broker) as consumer:
        listener = broker.listener
        good = listener.conninfo
        # Keep it down: its reconnects now go to a database that does not exist.
        listener.conninfo = libpq_url(database_url) + "_floor_no_such_database"
        failures = listener.failures
        pg.execute("SELECT pg_terminate_backend(%s)", (listener.backend_pid,))
        wait_until(lambda: listener.failures > failures and listener.backend_pid is None,
                   "the listener is down")

        # 1. While it is down, the timed poll carries the queue.
        broker.poll_interval = 0.2
        waiting = Next(consumer)
        wait_until(lambda: consumer.claims >= 1, "the consumer claimed once")
        job_id = send_job(state)
        message = waiting.join()
        assert message is not None and message.job_id == job_id
        consumer.ack(message)
        assert consumer.wakeups == 0  # no notification ended a wait: the poll did
        assert listener.backend_pid is None  # still down

        # 2. A job committed while it is down, its NOTIFY lost, with the poll an
        #    hour away: the reconnect wakes every queue once, and the job runs.
        broker.poll_interval = HOUR
        waiting = Next(consumer)
        wait_until(lambda: consumer.claims >= 3, "the consumer is waiting again")
        job_id = send_job(state)
        connects = listener.connects
        listener.conninfo = good
        assert listener.wait_connected(GUARD, after=connects)
        message = waiting.join()
        assert message is not None and message.job_id == job_id
        consumer.ack(message)


# -- lifecycle ----------------------------------------------------------------------------


def test_the_listener_stops_with_its_last_consumer_and_the_broker(app, broker, pg):
    with consuming(broker, QUEUE_LLM):
        with consuming(broker, QUEUE_TOOL):
            listener = broker.listener
            pid = listener.backend_pid
        assert listener.backend_pid == pid  # one consumer left: still listening
    wait_until(lambda: pid not in listener_backends(pg), "the last consumer's exit closed it")
    with consuming(broker, QUEUE_LLM):  # a later consumer starts it again
        assert broker.listener.backend_pid is not None
        again = broker.listener.backend_pid
        broker.close()  # the broker's close stops it even with a consumer left
        wait_until(lambda: again not in listener_backends(pg), "close() closed it")
