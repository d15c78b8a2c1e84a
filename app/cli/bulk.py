"""`kiln bulk` and `kiln schedule`: a bucket overnight, through the API (KILN_API_URL/KEY)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from kiln.app.cli.common import OptionPairs, VideoFps, console, job_options
from kiln.app.cli.remote import ApiClient, NotifyEvents, NotifyUrl, notify_request, verdict, watch

schedule_app = typer.Typer(help="Cron-timed incremental runs over a bucket (run by kiln beat).")

Include = Annotated[
    list[str] | None,
    typer.Option("--include", help="Glob on keys below the prefix, in any case (repeatable)."),
]
Exclude = Annotated[list[str] | None, typer.Option("--exclude", help="Glob to skip (repeatable).")]
CaseSensitive = Annotated[
    bool, typer.Option("--case-sensitive", help="Match the globs in case ('*.jpg' not A.JPG).")
]
RetryFailed = Annotated[
    bool,
    typer.Option(
        "--retry-failed",
        help="With --name: run again the unchanged objects that failed before (by default a "
        "rerun keeps them, counted as known failures, until the object or model changes).",
    ),
]
Output = Annotated[str | None, typer.Option(help="s3:// prefix for the results.")]


def _run(
    model: str,
    uri: str,
    include: list[str] | None,
    exclude: list[str] | None,
    output: str | None,
    option: list[str] | None,
    video_fps: float | None = None,
    case_sensitive: bool = False,
) -> dict[str, Any]:
    """What a bulk job and a schedule's runs share: the model, the source, where and how."""
    source: dict[str, Any] = {"s3": uri, "include": include or [], "exclude": exclude or []}
    body: dict[str, Any] = {"model": model, "source": source}
    if case_sensitive:
        source["case_sensitive"] = True
    if options := job_options(option, video_fps):
        body["options"] = options
    if output:
        body["output"] = output
    return body


def bulk(
    source: Annotated[str, typer.Argument(help="s3://bucket/prefix to process.")],
    model: Annotated[str, typer.Option(help="Model to run.")],
    name: Annotated[
        str | None,
        typer.Option(help="Incremental pipeline name: reruns process only new or changed objects."),
    ] = None,
    output: Output = None,
    include: Include = None,
    exclude: Exclude = None,
    case_sensitive: CaseSensitive = False,
    retry_failed: RetryFailed = False,
    watch_: Annotated[bool, typer.Option("--watch", help="Follow with a progress bar.")] = False,
    option: OptionPairs = None,
    video_fps: VideoFps = None,
    notify: NotifyUrl = None,
    notify_events: NotifyEvents = None,
    expires_after: Annotated[
        str | None,
        typer.Option(
            "--expires-after",
            help='Keep its items and results this long after it ends ("7d", "12h", seconds; '
            "default: the tenant's or the deployment's retention).",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Create nothing: list the prefix (a sample of a huge one, saying so) and print "
            "its objects, bytes, images, videos and frames, and the time at the fleet's measured "
            "rate for the model with the workers alive now.",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="With --dry-run: print the estimate as JSON.")
    ] = False,
) -> None:
    """Process every object under an S3 prefix (listed by the workers, page by page); each
    video becomes one item per sampled frame. With --watch, exits 1 when the job failed, the
    prefix and filters matched no object, or no item succeeded; 0 otherwise (a rerun with
    nothing new, or whose only failures are known ones, included). With --dry-run, only
    estimates it."""
    if retry_failed and not name:
        raise typer.BadParameter(
            "goes with --name (only a pipeline's runs keep failures).",
            param_hint="'--retry-failed'",
        )
    body = _run(model, source, include, exclude, output, option, video_fps, case_sensitive)
    if name:
        body["pipeline"] = name
    if retry_failed:
        body["retry_failed"] = True
    if dry_run:
        with ApiClient() as client:
            found = client.estimate(_run(model, source, include, exclude, None, option, video_fps,
                                         case_sensitive))  # fmt: skip
        _print_estimate(found, as_json)
        return
    if hook := notify_request(notify, notify_events):
        body["notify"] = hook
    if expires_after is not None:  # the API checks it (a 422's sentence, as any refusal)
        body["expires_after"] = expires_after
    with ApiClient() as client:
        job = client.submit_json(body)
        console.print(f"job {job['id']} {job['status']}: listing {source}")
        if watch_:
            raise typer.Exit(verdict(client, watch(client, job["id"])))


def _print_estimate(found: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(found, indent=2))
        return
    console.print("Estimate (--dry-run: no job created)")
    table = Table("", "estimate")
    sampled = " (sampled)" if found["sampled"] else ""
    table.add_row("objects", f"{found['objects']:,}{sampled}")
    table.add_row("listed", f"{found['listed']:,}")
    table.add_row("bytes", _size(found["bytes"]))
    table.add_row("images", f"{found['images']:,}")
    frames = found["frames"]
    table.add_row("videos", f"{found['videos']:,}" + (f" → {frames:,} frames" if frames else ""))
    table.add_row("items", f"{found['items']:,}")
    rate = found["rate_per_s"]
    table.add_row("rate", f"{rate:,.1f} items/s" if rate else "not measured yet")
    table.add_row("workers", str(found["workers"]))
    seconds = found["seconds"]
    table.add_row("time", _duration(seconds) if seconds is not None else "unknown")
    console.print(table)
    if found["note"]:
        console.print(found["note"])


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1000
    return f"{count} B"


def _duration(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{seconds:.1f} s"


@schedule_app.command("add")
def schedule_add(
    name: Annotated[str, typer.Argument(help="Schedule (and pipeline) name.")],
    cron: Annotated[
        str, typer.Option(help="Cron expression in UTC, e.g. '0 2 * * *' or @daily (@hourly…).")
    ],
    source: Annotated[str, typer.Option(help="s3://bucket/prefix to process.")],
    model: Annotated[str, typer.Option(help="Model to run.")],
    output: Output = None,
    include: Include = None,
    exclude: Exclude = None,
    case_sensitive: CaseSensitive = False,
    retry_failed: RetryFailed = False,
    option: OptionPairs = None,
    video_fps: VideoFps = None,
) -> None:
    """Run MODEL over SOURCE at each CRON time; each run processes only what changed (and,
    with --retry-failed, the objects that failed before)."""
    run = _run(model, source, include, exclude, output, option, video_fps, case_sensitive)
    body = {"name": name, "cron": cron, **run}
    if retry_failed:
        body["retry_failed"] = True
    with ApiClient() as client:
        schedule = client.add_schedule(body)
    console.print(f"schedule {schedule['name']}: next run {schedule['next_run_at']}")


@schedule_app.command("list")
def schedule_list() -> None:
    """Your schedules."""
    with ApiClient() as client:
        rows = client.schedules()
    table = Table("name", "cron", "model", "source", "next run", "last job")
    for s in rows:
        table.add_row(
            s["name"], s["cron"], s["model"], s["source"]["s3"], s["next_run_at"],
            s["last_job_id"] or "–",
        )  # fmt: skip
    console.print(table)


@schedule_app.command("remove")
def schedule_remove(name: str) -> None:
    """Stop a schedule (a run already started goes on)."""
    with ApiClient() as client:
        client.remove_schedule(name)
    console.print(f"schedule {name} removed")
