"""`kiln submit|jobs|status|results|cancel`: a client of a Kiln API (KILN_API_URL, KILN_API_KEY).

Wherever a job id is asked for, its first eight characters (as `kiln jobs`, the bars and the
console show it) or any unique prefix of four or more will do."""

from __future__ import annotations

import itertools
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from kiln.app.cli import watch_lines
from kiln.app.cli.common import OptionPairs, VideoFps, console, errors, fail, job_options, settings
from kiln.app.cli.verdict import Ended, Kind, decide
from kiln.app.core.errors import KilnError
from kiln.app.jobs import job_counts

NotifyUrl = Annotated[
    str | None,
    typer.Option(help="A webhook URL Kiln POSTs the job's answer to when it ends (signed)."),
]
NotifyEvents = Annotated[
    str | None,
    typer.Option(help="Which ends --notify reports: completed,failed,cancelled (default: all)."),
]


def submit(
    files: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False)],
    model: Annotated[str, typer.Option(help="Model to run.")],
    wait: Annotated[bool, typer.Option(help="Wait until the job finishes.")] = False,
    option: OptionPairs = None,
    video_fps: VideoFps = None,
    notify: NotifyUrl = None,
    notify_events: NotifyEvents = None,
) -> None:
    """Submit files (images, videos) to the API at KILN_API_URL."""
    options = job_options(option, video_fps)
    hook = notify_request(notify, notify_events)
    with ApiClient() as client:
        job = client.submit(files, model, options, hook)
        total = job["counts"]["total"]
        console.print(f"job {job['id']} {job['status']} ({total} item{'' if total == 1 else 's'})")
        if wait:
            raise typer.Exit(verdict(client, watch(client, job["id"])))


def status(
    job_id: str,
    follow: Annotated[
        bool, typer.Option("--watch", help="Follow with a progress bar, items/s and ETA.")
    ] = False,
) -> None:
    """Show a job's status and counts."""
    with ApiClient() as client:
        if follow:
            raise typer.Exit(verdict(client, watch(client, job_id)))
        job = client.job(job_id)
        _print_job(job)
        _print_deliveries(job.get("notify"))


def results_cmd(
    job_id: Annotated[str | None, typer.Argument(help="The job (or give --pipeline).")] = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Parquet file to write.")
    ] = None,
    pipeline: Annotated[
        str | None,
        typer.Option(
            "--pipeline",
            help="A pipeline's current results instead: one row per live object, its latest.",
        ),
    ] = None,
    urls: Annotated[
        bool, typer.Option("--urls", help="Print presigned URLs instead (S3 storage only).")
    ] = False,
    expires: Annotated[
        int, typer.Option(min=1, max=3600, help="Seconds the --urls stay valid (≤ 3600).")
    ] = 900,
    groups: Annotated[
        bool, typer.Option("--groups", help="Download the closed job's duplicate groups instead.")
    ] = False,
) -> None:
    """Download a job's results (or its duplicate groups) as one Parquet file, or print
    presigned URLs of its files; with --pipeline, a pipeline's current results."""
    if pipeline is not None:
        _pipeline_results(pipeline, output, job_id, urls or groups)
        return
    if job_id is None:
        raise fail(KilnError("Name a job, or a pipeline with --pipeline NAME."))
    if not urls and output is None:
        raise fail(KilnError("Give -o FILE to download the results, or --urls for links."))
    with ApiClient() as client:
        if urls:
            signed = client.result_urls(job_id, expires)
            for entry in ([signed["manifest"]] if signed["manifest"] else []) + signed["shards"]:
                typer.echo(f"{entry['key']}\t{entry['url']}")  # plain: for scripts, no wrapping
            return
        assert output is not None
        client.download_results(job_id, output, "groups" if groups else "results")
    console.print(f"{'groups' if groups else 'results'} of {job_id} written to {output}")


def _pipeline_results(name: str, output: Path | None, job_id: str | None, other: bool) -> None:
    """`kiln results --pipeline NAME -o FILE`: the pipeline's current results (one file)."""
    if job_id is not None or other:
        raise fail(KilnError("--pipeline goes alone with -o FILE: no job, --urls or --groups."))
    if output is None:
        raise fail(KilnError("Give -o FILE to download the pipeline's current results."))
    import pyarrow.parquet as pq  # only for the row count said at the end

    with ApiClient() as client:
        client.download_pipeline_results(name, output)
    rows = pq.ParquetFile(output).metadata.num_rows
    console.print(f"current results of pipeline {name} ({rows:,} rows) written to {output}")


JobStatusName = Literal["queued", "running", "cancelling", "completed", "failed", "cancelled"]
SHORT_ID = 8  # characters of an id shown; any unique prefix of 4 or more names the job


def jobs_cmd(
    status_: Annotated[
        JobStatusName | None, typer.Option("--status", help="Only jobs of this status.")
    ] = None,
    pipeline: Annotated[
        str | None, typer.Option(help="Only the runs of this pipeline (`kiln bulk --name`).")
    ] = None,
    schedule: Annotated[
        str | None, typer.Option(help="Only the runs this schedule started.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many.")] = 20,
    quiet: Annotated[
        bool, typer.Option("-q", "--quiet", help="Full ids only, one a line (for scripts).")
    ] = False,
) -> None:
    """Your jobs, newest first: id, status, model, items done, when, pipeline or schedule."""
    with ApiClient() as client:
        found = client.jobs(limit, status=status_, pipeline=pipeline, schedule=schedule)
    if quiet:
        for job in found:
            typer.echo(job["id"])
        return
    if not found:
        errors.print("No jobs" + (" match." if status_ or pipeline or schedule else " yet."))
        return
    table = Table("id", "status", "model", "items", "created", "pipeline / schedule")
    shown = short_ids([job["id"] for job in found])
    for job, short in zip(found, shown, strict=True):
        table.add_row(
            short, job["status"], job["model"], _items(job["counts"]),
            _when(job["created_at"]), escape(_started_by(job)),
        )  # fmt: skip
    console.print(table)


def short_ids(ids: list[str]) -> list[str]:
    """Each id's first SHORT_ID characters, or more where two listed ids share them, so every
    one shown names its job among those listed (neighbours in sorted order share the most)."""
    ordered = sorted(set(ids))
    needs = dict.fromkeys(ordered, SHORT_ID)
    for one, next_ in itertools.pairwise(ordered):
        shared = _shared(one, next_)
        needs[one], needs[next_] = max(needs[one], shared + 1), max(needs[next_], shared + 1)
    return [job_id[: needs[job_id]] for job_id in ids]


def _shared(one: str, other: str) -> int:
    """How many first characters the two have in common."""
    same = itertools.takewhile(lambda pair: pair[0] == pair[1], zip(one, other, strict=False))
    return sum(1 for _ in same)


def _items(counts: dict[str, Any]) -> str:
    """Items ended of the total, and how many failed."""
    ended = counts["succeeded"] + counts["failed"] + counts["cancelled"]
    line = f"{ended}/{counts['total']}"
    return line + f" ({counts['failed']} failed)" if counts["failed"] else line


def _when(stamp: str) -> str:
    """An API timestamp as local date and time, to the minute."""
    return datetime.fromisoformat(stamp).astimezone().strftime("%Y-%m-%d %H:%M")


def _started_by(job: dict[str, Any]) -> str:
    pipeline, schedule = job.get("pipeline"), job.get("schedule")
    if schedule and pipeline in (None, schedule):
        return f"{schedule} (schedule)"
    if schedule:
        return f"{pipeline} (schedule {schedule})"
    return pipeline or "–"


def cancel(job_id: str) -> None:
    """Cancel a job; finished results are kept."""
    with ApiClient() as client:
        _print_job(client.cancel(job_id))


class ApiClient:
    def __enter__(self) -> Any:
        from kiln.app.cli.client import KilnClient

        current = settings()
        try:
            self.client = KilnClient(current.api_url, current.api_key)
        except KilnError as error:
            raise fail(error) from None
        return self.client

    def __exit__(self, kind: Any, error: Any, _tb: Any) -> None:
        self.client.close()
        if isinstance(error, KilnError):
            raise fail(error) from None


def verdict(client: Any, job: dict[str, Any]) -> int:
    """The exit status of a job waited for, as `kiln run`'s (`cli/verdict.decide`): 1, and
    why on stderr, when it failed, was cancelled, its bucket source matched no object, or no
    item succeeded; else 0, failed items and all (the results say why each failed), and a
    pipeline's run with nothing new says so."""
    decided = decide(Ended.of_job(job))
    said = decided.sentence
    if said is None:
        return 0
    if decided.code == 0:
        console.print(escape(said), highlight=False, soft_wrap=True)  # one line in a log
        return 0
    if decided.first_error and (first := client.first_error(job["id"])):
        said += f" The first error: {first}"
    prefix = "" if decided.kind == Kind.CANCELLED else "[red]error:[/red] "
    errors.print(prefix + escape(said), highlight=False, soft_wrap=True)
    return decided.code


def watch(client: Any, job_id: str) -> dict[str, Any]:
    """Follow the job until it closes, then print its summary: a live bar in a terminal, else
    (cron, `| tee`: where the bar draws nothing) a plain line now and then (`watch_lines`)."""
    job: dict[str, Any] = client.job(job_id)  # before the bar: a job not there is a sentence
    if console.is_terminal and errors.is_terminal:
        job = _bar(client, job)
    else:
        job = watch_lines.follow(lambda: client.job(job_id), job, _log_line)
    _print_job(job)
    return job


def _log_line(line: str) -> None:
    """One line of a log as it is, however long: not wrapped at 80 columns, no markup read."""
    console.print(line, soft_wrap=True, markup=False, highlight=False)


def _bar(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    """A live bar until the job closes: done of total, items/s and the API's ETA. While a bulk
    job is still listing its bucket, or its videos are being expanded into frames, the total
    grows (and while listing the ETA is unknown)."""
    job_id = job["id"]
    with Progress(
        TextColumn(job_id[:8]),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TextColumn("{task.fields[eta]}"),
        console=errors,
    ) as bar:
        task = bar.add_task("job", total=None, rate="", eta="")
        while True:
            c = job["counts"]
            bar.update(
                task,
                total=None if job.get("listing") else c["total"],
                completed=c["done"],
                rate=_rate(job),
                eta=_eta(job),
            )
            if job["status"] in ("completed", "failed", "cancelled"):
                return job
            time.sleep(0.5)
            job = client.job(job_id)


def _rate(job: dict[str, Any]) -> str:
    """items/s over the last minute, what is running now, and a stall when there is one."""
    running = job["counts"].get("running", 0)
    line = f"{job['items_per_second'] or 0:.1f} items/s, {running} running"
    if job.get("stalled_since"):
        line += f" — stalled since {_clock(job['stalled_since'])} (a worker stopped)"
    if job.get("waiting_for_worker"):
        line += " — no worker is running (start `kiln worker`)"
    return line


def _clock(stamp: str) -> str:
    """An API timestamp as the local wall-clock time."""
    return datetime.fromisoformat(stamp).astimezone().strftime("%H:%M:%S")


def _eta(job: dict[str, Any]) -> str:
    if job.get("listing"):
        skipped = job["counts"].get("skipped", 0)
        return f"listing… ({skipped} unchanged)" if skipped else "listing…"
    eta = job.get("eta_seconds")
    when = "" if eta is None else f"ETA {int(eta) // 60}:{int(eta) % 60:02d}"
    if videos := job["counts"].get("expanding"):  # the total grows by their frames
        return f"expanding {videos} video{'s' if videos != 1 else ''} into frames… {when}".rstrip()
    return when


def notify_request(url: str | None, events: str | None) -> dict[str, Any] | None:
    """`--notify URL [--notify-events …]` as the API takes it (it checks the URL itself)."""
    from kiln.app.jobs.webhooks import EVENTS, parse_events

    if url is None:
        if events is not None:
            raise fail(KilnError("--notify-events needs --notify URL."))
        return None
    try:
        return {"url": url, "events": parse_events(events or ",".join(EVENTS))}
    except KilnError as error:
        raise fail(error) from None


def _print_deliveries(notify: dict[str, Any] | None) -> None:
    """The job's webhook and each delivery's attempts (`kiln status`)."""
    if not notify:
        return
    console.print(f"webhook {notify['url']} ({', '.join(notify['events'])})", soft_wrap=True)
    for d in notify.get("deliveries") or []:
        line = f"  {d['event']}: {d['status']} after {d['attempts']} attempt(s), id {d['id']}"
        if d.get("last_status"):
            line += f", last HTTP {d['last_status']}"
        if d["status"] == "pending" and d.get("next_attempt_at"):
            line += f", next at {_clock(d['next_attempt_at'])}"
        if d["status"] != "delivered" and d.get("last_error"):
            line += f": {d['last_error']}"
        console.print(escape(line), soft_wrap=True)


def _print_job(job: dict[str, Any]) -> None:
    c = job["counts"]
    line = (
        f"job {job['id']} {job['status']}: {c['succeeded']} succeeded, {c['failed']} failed, "
        f"{c.get('running', 0)} running, {c['pending']} pending of {c['total']}"
    )
    if c.get("cancelled"):
        line += f", {c['cancelled']} cancelled"
    if job.get("source"):
        line += f"; {job_counts.left_alone_text(c)}"
    console.print(line, soft_wrap=True)  # one line in a log too, however long
    if job.get("stalled_since"):
        console.print(
            f"[yellow]Stalled since {_clock(job['stalled_since'])}: a worker holding some items "
            "stopped renewing them; kiln beat's reconciler sends them to another worker once "
            "their lease runs out.[/yellow]"
        )
    if job.get("waiting_for_worker"):
        console.print(
            "[yellow]No worker has reported in the last 30 s: the job waits until one starts "
            "(`kiln worker`).[/yellow]"
        )
    if job.get("error"):
        console.print(f"[red]{job['error']}[/red]")
