"""The Dispatcher on PostgreSQL: the lease-keeping and outage scenarios of the SQLite suite,
run unchanged with the queue in a PostgreSQL database (this module's ``db`` and ``places``),
the property test of random send durations over many cycles included."""

from __future__ import annotations

import pytest

from .pgdb import one_at_a_time
from .test_dispatch_leases import (  # noqa: F401  (collected again, here on PostgreSQL)
    queue,
    test_a_lease_capped_at_its_deadline_is_not_extended_again,
    test_a_real_sink_slower_than_half_the_lease_gets_each_job_once,
    test_a_ticket_whose_extension_is_refused_is_lost_not_sent_or_finished,
    test_random_send_durations_up_to_three_leases_every_job_done_once,
    test_sends_slower_than_the_lease_end_done_at_token_1,
    test_the_summary_is_new_for_each_run,
)
from .test_dispatch_outage import (  # noqa: F401
    test_a_job_s_own_failure_is_still_charged,
    test_a_job_whose_deadline_passes_during_the_outage_is_counted_dead,
    test_a_sink_answering_503_or_hanging_for_a_while,
    test_jobs_the_quarantine_ends_are_counted_in_the_summary,
    test_nothing_listening_for_a_while_then_a_sink_every_job_done,
    test_the_retry_policy_is_the_worker_s,
)


@pytest.fixture
def db(pg_db):
    return pg_db()


@pytest.fixture
def places(pg_pool):
    yield from one_at_a_time(pg_pool)


@pytest.fixture
def lease_ms():
    """Longer than on a file: a server's commits share the machine with the other test workers."""
    return 800
