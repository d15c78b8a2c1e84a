"""What every `kiln` command shares: consoles, settings, a database session, failures."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from kiln.app.core.config import Settings

console = Console()
errors = Console(stderr=True)

# `--option KEY=VALUE`, repeatable: a job option of the model's family (kiln.app.families).
OptionPairs = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        metavar="KEY=VALUE",
        help="A model option, e.g. max_distance=8 (repeatable); VALUE is JSON if it parses.",
    ),
]


VideoFps = Annotated[
    float | None,
    typer.Option(
        "--video-fps",
        min=0,
        help="Frames sampled per second of each video (default 1; 0: every frame).",
    ),
]


def with_video_fps(options: dict[str, Any], fps: float | None) -> dict[str, Any]:
    """A job's options with its `video_fps`, where the command line gave one (a whole number
    as an int, so a refusal echoes `--video-fps 5000` as 5000, as it was typed)."""
    if fps is None:
        return options
    return {**options, "video_fps": int(fps) if fps.is_integer() else fps}


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """`["max_distance=8", "note=x"]` → `{"max_distance": 8, "note": "x"}`; the API checks
    the keys and types against the model's family."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE.", param_hint="'--option'")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value  # a bare word is text, as a shell user means it
    return options


def job_options(pairs: list[str] | None, fps: float | None) -> dict[str, Any]:
    """A job's options from the command line: its `--option` pairs and `--video-fps`."""
    return with_video_fps(parse_options(pairs), fps)


def settings() -> Settings:
    """The environment's settings; a value Kiln cannot take is a sentence naming its variable
    (exit 1), not pydantic's traceback."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from kiln.app.core.config import get_settings  # pydantic: when a command runs, not for --help
    from kiln.app.core.errors import KilnError

    try:
        return get_settings()
    except ValidationError as error:
        raise fail(KilnError(settings_sentence(error))) from None
    except SettingsError as error:  # a value that is not even JSON (a dict's, a list's)
        raise fail(KilnError(unparsed_sentence(error))) from None


CANNOT_START = "Kiln cannot start with this environment: "


def settings_sentence(error: Any) -> str:
    """`KILN_X='v': why` for each value refused (a pydantic `ValidationError`; a value a
    union refused has each of its members' reasons, joined by "or"; an entry of a JSON
    value is named inside its variable)."""
    from typing import get_origin

    from kiln.app.core.config import Settings

    said: dict[str, list[str]] = {}
    for problem in error.errors(include_url=False):
        loc = problem["loc"]
        where = "KILN_" + str(loc[0]).upper() if loc else "A setting"
        field = Settings.model_fields.get(str(loc[0])) if loc else None
        if len(loc) > 1 and field is not None and get_origin(field.annotation) is dict:
            where += f" (its {loc[1]!r} entry)"  # else loc[1] names a union's member
        given = _shown(str(loc[0]) if loc else "", problem.get("input"))
        where += f"={given!r}" if isinstance(given, (str, int, float)) else ""
        said.setdefault(where, []).append(problem["msg"].removeprefix("Value error, "))
    parts = [f"{where}: {' or '.join(why)}" for where, why in said.items()]
    return CANNOT_START + "; ".join(parts) + "."


def _shown(name: str, given: object) -> object:
    """A refused value as a sentence may show it: a URL's password and a secret hidden."""
    from kiln.app.core.config import redact_url

    if "secret" in name or "key" in name:
        return "***"
    if name.endswith("_url") and isinstance(given, str):
        return redact_url(given)
    return given


def unparsed_sentence(error: Exception) -> str:
    """pydantic-settings' refusal of a value it could not parse, as a sentence naming the
    variable, why, and what it takes."""
    import re

    from kiln.app.core.config import Settings

    found = re.search(r'field "(\w+)"', str(error))
    if found is None:
        return CANNOT_START + str(error) + "."
    name = found.group(1)
    why = f" ({error.__cause__})" if error.__cause__ else ""
    field = Settings.model_fields.get(name)
    takes = f" It takes: {field.description}" if field and field.description else ""
    return f"{CANNOT_START}KILN_{name.upper()} could not be read{why}.{takes}"


def fail(error: Exception) -> typer.Exit:
    """Print the error's sentence (never a traceback) and exit 1."""
    errors.print(f"[red]error:[/red] {error}")
    return typer.Exit(1)


def session() -> Any:
    from kiln.app.db.session import make_engine, make_session_factory

    current = settings()
    if current.database_url.startswith("sqlite"):
        from kiln.app.db.migrate import upgrade

        upgrade(current)  # the embedded default prepares its own database, as `kiln run` does
    return make_session_factory(make_engine(current.database_url))()


def redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
