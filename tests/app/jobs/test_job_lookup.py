"""`find_job` (behind every route that takes a job id): a job by its id or a unique prefix of
it, an ambiguous prefix answered with how many jobs it matches, an unknown one with the 404's
sentence; and `cancel_job` by a prefix. On SQLite; the same on Postgres, through the API and
the CLI, is in tests/integration/test_jobs_found.py."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.db.models import Job, JobStatus
from kiln.app.jobs.job_lookup import find_job
from kiln.app.jobs.jobs import cancel_job

FIRST = "4665f751-0000-4000-8000-000000000001"
SECOND = "4665f751-0000-4000-8000-000000000002"
THIRD = "4665f7aa-0000-4000-8000-000000000003"
ALONE = "9a1b2c3d-0000-4000-8000-000000000004"
ELSEWHERE = "ee11ee11-0000-4000-8000-000000000005"  # globex's


@pytest.fixture(autouse=True)
def _jobs(session: Session) -> None:
    for job_id in (FIRST, SECOND, THIRD, ALONE):
        session.add(Job(id=job_id, tenant="acme", model="phash", status=JobStatus.RUNNING))
    session.add(Job(id=ELSEWHERE, tenant="globex", model="phash", status=JobStatus.RUNNING))
    session.commit()


@pytest.mark.parametrize("given", [ALONE, ALONE[:8], ALONE[:4], ALONE[:13], ALONE[:8].upper()])
def test_an_id_or_a_unique_prefix_of_it_finds_the_job(session: Session, given: str) -> None:
    assert find_job(session, "acme", given).id == ALONE


def test_a_full_id_that_is_a_prefix_of_none_other_is_found_exactly(session: Session) -> None:
    assert find_job(session, "acme", FIRST).id == FIRST
    assert find_job(session, "acme", "4665f7a").id == THIRD


def test_an_ambiguous_prefix_says_how_many_jobs_it_matches_and_which(session: Session) -> None:
    with pytest.raises(InputError) as raised:
        find_job(session, "acme", "4665f751")
    assert str(raised.value) == (
        f"2 of your jobs have an id starting with 4665f751 ({FIRST}, {SECOND}); give more of it."
    )
    with pytest.raises(InputError, match=r"^3 of your jobs have an id starting with 4665 \("):
        find_job(session, "acme", "4665")


def test_more_matches_than_are_named_end_with_an_ellipsis(session: Session) -> None:
    session.add(Job(id="4665" + ALONE[4:], tenant="acme", model="phash"))
    session.commit()
    with pytest.raises(InputError, match=r"^4 of your jobs .*, …\); give more of it\.$"):
        find_job(session, "acme", "4665")


@pytest.mark.parametrize("given", ["ffff", "not-a-job", "4665%", "4665_", "ee11ee11", ELSEWHERE])
def test_an_unknown_id_or_another_tenants_is_todays_404(session: Session, given: str) -> None:
    with pytest.raises(NotFoundError) as raised:
        find_job(session, "acme", given)
    assert str(raised.value) == f"There is no job {given}."


def test_a_prefix_shorter_than_four_characters_says_how_long_one_must_be(
    session: Session,
) -> None:
    with pytest.raises(NotFoundError) as raised:
        find_job(session, "acme", "9a1")
    assert str(raised.value) == (
        "There is no job 9a1; name a job by its id or at least 4 of its first characters."
    )


def test_cancel_takes_a_prefix_and_names_the_whole_id(session: Session) -> None:
    assert cancel_job(session, "acme", ALONE[:8]).id == ALONE
    with pytest.raises(InputError, match="2 of your jobs"):
        cancel_job(session, "acme", "4665f751")
    with pytest.raises(NotFoundError, match=f"^There is no job {ELSEWHERE[:8]}.$"):
        cancel_job(session, "acme", ELSEWHERE[:8])
