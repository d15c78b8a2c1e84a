"""POST /v1/jobs/estimate's door: checked as a submission is (the same 4xx sentences), and
nothing is created. Listing a real bucket: tests/integration/test_estimate.py."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db.models import Job
from tests.app.api.conftest import TestClient


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({"model": "phash", "inputs": [{"text": "a"}]}, 422, 'give a "source"'),
        ({"model": "phash", "source": {"s3": "s3://photos/"}}, 403, "photos"),
        ({"model": "nope", "source": {"s3": "s3://photos/"}}, 422, "nope"),
        ({"model": "phash", "source": {"s3": "photos/2026"}}, 422, "S3 URI"),
        ({"model": "phash", "source": {"s3": "s3://photos/"}, "video_fps": -1}, 422, "video_fps"),
        ({"model": "phash", "source": {"s3": "s3://photos/"}, "options": {"x": 1}}, 422, "x"),
        ({"source": {"s3": "s3://photos/"}}, 422, "model"),
    ],
)
def test_a_refused_estimate_says_why_and_creates_nothing(
    client: TestClient, sessions: sessionmaker[Session], body: dict[str, Any], code: int,
    words: str,
) -> None:  # fmt: skip
    response = client.post("/v1/jobs/estimate", json=body)
    assert response.status_code == code, response.text
    assert words in response.json()["detail"]
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
