"""Errors Starlette and the database raise still leave as a status and a sentence."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DataError

from kiln.app.api.app import create_app
from kiln.app.core.config import Settings
from tests.app.api.conftest import TestClient


def test_an_unknown_route_is_a_404_sentence(client: TestClient) -> None:
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["detail"] == (
        "There is no route for GET /v1/nothing-here; the routes are listed at /docs."
    )


def test_a_wrong_method_is_a_405_sentence_with_allow(client: TestClient) -> None:
    response = client.delete("/v1/jobs")
    assert response.status_code == 405
    assert response.json()["detail"] == (
        "/v1/jobs does not take DELETE; the routes are listed at /docs."
    )
    assert response.headers["allow"]


def test_own_http_details_are_kept_and_end_as_sentences(client: TestClient) -> None:
    response = client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    assert response.json()["detail"] == "The API key is unknown or revoked."
    assert response.headers["www-authenticate"] == "Bearer"
    # Not UTF-8: FastAPI's own 400, whose detail gains its full stop.
    broken = client.post(
        "/v1/schedules", content=b"e2[?\xff\xfe", headers={"Content-Type": "application/json"}
    )
    assert broken.status_code == 400
    assert broken.json()["detail"] == "There was an error parsing the body."


def test_values_the_database_refuses_are_422(settings: Settings) -> None:
    app = create_app(settings)

    @app.get("/refused")
    def refused() -> None:
        raise DataError("INSERT …", {}, ValueError("invalid input syntax for type json"))

    with TestClient(app) as http:
        response = http.get("/refused")
    assert response.status_code == 422
    assert "cannot store" in response.json()["detail"]


@pytest.mark.parametrize(
    ("path", "method"), [("/v1/jobs", "post"), ("/v1/models", "post"), ("/v1/schedules", "post")]
)
def test_routes_that_parse_bodies_document_400(settings: Settings, path: str, method: str) -> None:
    responses = create_app(settings).openapi()["paths"][path][method]["responses"]
    assert "400" in responses, sorted(responses)
