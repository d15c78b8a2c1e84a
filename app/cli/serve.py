"""`kiln api`, `kiln worker`, `kiln flower`, `kiln beat`: the long-running processes."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from kiln.app.cli.common import fail, settings
from kiln.app.core.errors import KilnError
from kiln.app.dispatch.contract import QUEUES

LOGLEVEL_HELP = "Log level (default: KILN_LOG_LEVEL, else INFO)."


def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Serve the HTTP API."""
    import uvicorn

    from kiln.app.api.app import create_app
    from kiln.app.observability import log_level, observe

    current = settings()
    observe(current, "api")
    # log_config=None: uvicorn's loggers propagate to the root handler `observe` installed.
    level = log_level(current, None).lower()
    uvicorn.run(create_app(current), host=host, port=port, log_level=level, log_config=None)


def worker(
    concurrency: Annotated[int | None, typer.Option(help="Task threads.")] = None,
    queues: Annotated[str, typer.Option(help="Queues, highest priority first.")] = ",".join(QUEUES),
    hostname: Annotated[str | None, typer.Option(help="Celery node name.")] = None,
    loglevel: Annotated[str | None, typer.Option(help=LOGLEVEL_HELP)] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port.")
    ] = None,
    device: Annotated[
        int | None, typer.Option(help="Run on this GPU only (CUDA_VISIBLE_DEVICES).")
    ] = None,
    devices: Annotated[
        str | None, typer.Option(help="'all': one worker process per visible GPU.")
    ] = None,
    ready_file: Annotated[
        Path | None, typer.Option(help="Written once ready (after --warm), removed on shutdown.")
    ] = None,
    warm: Annotated[
        str | None, typer.Option(help="Built-in models to build before ready, e.g. 'ocr,detector'.")
    ] = None,
    live_file: Annotated[
        Path | None,
        typer.Option(help="Touched every 5 s while healthy (a liveness probe reads its age)."),
    ] = None,
) -> None:
    """Run a worker: task threads feed one Batcher per model; one process per GPU."""
    if devices is not None:
        raise typer.Exit(_fleet(devices, concurrency, queues, loglevel, metrics_port, live_file))
    if device is not None:
        from kiln.workers.ops.device import pin

        pin(device)  # before anything imports CUDA: the engine is built later, in this process
    node = hostname or (f"gpu{device}@{socket.gethostname()}" if device is not None else None)
    ready = _readiness(ready_file, warm)
    host = socket.gethostname()
    _work(
        concurrency, queues, node or f"cpu@{host}", loglevel, metrics_port, ready, warm, live_file
    )


def _readiness(ready_file: Path | None, warm: str | None) -> Path | None:
    from kiln.app.catalog.catalog import BUILTINS
    from kiln.workers.ops.readiness import parse_models

    unknown = [name for name in parse_models(warm) if name not in BUILTINS]
    if unknown:
        known = ", ".join(BUILTINS)
        raise fail(KilnError(f"--warm takes built-in models ({known}), not {', '.join(unknown)}."))
    if warm and ready_file is None:
        raise fail(KilnError("--warm needs --ready-file: readiness is what the warm-up delays."))
    return ready_file


def _work(
    concurrency: int | None,
    queues: str,
    node: str,
    loglevel: str | None,
    metrics_port: int | None,
    ready: Path | None = None,
    warm: str | None = None,
    live: Path | None = None,
) -> None:
    from kiln.app.observability import log_level, observe
    from kiln.workers.celery.app import make_celery
    from kiln.workers.ops.facts import start_publishing
    from kiln.workers.ops.liveness import Heartbeat
    from kiln.workers.ops.metrics import serve_metrics, worker_registry
    from kiln.workers.ops.readiness import install, parse_models, warm_models
    from kiln.workers.prep.slots import reclaim

    current = settings()
    observe(current, "worker", loglevel)  # before Celery: it keeps a configured root
    reclaim()  # shared memory a worker killed on this host could not unlink
    celery = make_celery(current)
    celery.node_name = node
    if ready is not None:
        install(ready, warm_models(celery.runtime, parse_models(warm)))
    port = metrics_port or current.worker_metrics_port
    if port:
        serve_metrics(port, worker_registry(celery))
    heartbeat = Heartbeat(live, celery.health_problems).start() if live is not None else None
    facts = start_publishing(current, node, celery)  # the console's fleet page reads them
    try:
        celery.Worker(
            pool_cls="threads",
            concurrency=concurrency or current.task_threads,
            queues=queues.split(","),
            hostname=node,
            loglevel=log_level(current, loglevel),
            send_events=True,
        ).start()
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        facts.stop()
        celery.close_runtime()


def _fleet(
    devices: str,
    concurrency: int | None,
    queues: str,
    loglevel: str | None,
    metrics_port: int | None,
    live: Path | None = None,
) -> int:
    from kiln.workers.ops.device import list_gpus
    from kiln.workers.ops.fleet import Fleet, child_args, live_path, prep_share
    from kiln.workers.prep.pool import usable_cores

    if devices != "all":
        raise fail(KilnError("--devices takes 'all'; use --device N for one GPU."))
    gpus = list_gpus()
    host = socket.gethostname()
    extra = ["--queues", queues] + (["--loglevel", loglevel] if loglevel else [])
    if concurrency:
        extra += ["--concurrency", str(concurrency)]
    if not gpus:
        typer.echo("no GPU visible (NVML): running one CPU worker", err=True)
        _work(concurrency, queues, f"cpu@{host}", loglevel, metrics_port, live=live)
        return 0
    port = metrics_port or settings().worker_metrics_port
    typer.echo(f"{len(gpus)} GPU(s): " + ", ".join(f"{g.index}: {g.name}" for g in gpus), err=True)
    # The host's cores are shared out: each device's worker gets its part as prep processes.
    os.environ.setdefault("KILN_PREP_PROCESSES", str(prep_share(usable_cores(), len(gpus))))
    commands = [child_args(g, host, extra, port, live) for g in gpus]
    return Fleet(commands, [live_path(live, g) if live else None for g in gpus]).run()


# Flower's OAuth login (it reads FLOWER_* itself): all four set, or basic auth.
FLOWER_OAUTH_ENV = (
    "FLOWER_AUTH_PROVIDER",
    "FLOWER_AUTH",
    "FLOWER_OAUTH2_KEY",
    "FLOWER_OAUTH2_SECRET",
)


def flower(port: Annotated[int, typer.Option(help="Port for the Flower UI.")] = 5555) -> None:
    """Flower against the configured broker; refuses to start without authentication."""
    from kiln.workers.celery.app import make_celery

    auth = os.environ.get("KILN_FLOWER_BASIC_AUTH")
    args = ["flower", f"--port={port}"]
    if auth and ":" in auth:
        args.append(f"--basic-auth={auth}")
    elif not all(os.environ.get(name) for name in FLOWER_OAUTH_ENV):
        raise fail(
            KilnError(
                "Set KILN_FLOWER_BASIC_AUTH=user:password, or Flower's own OAuth variables ("
                + ", ".join(FLOWER_OAUTH_ENV)
                + "); Flower never runs open."
            )
        )
    make_celery(settings()).start(args)  # Flower reads its FLOWER_* variables itself


def beat(loglevel: Annotated[str | None, typer.Option(help=LOGLEVEL_HELP)] = None) -> None:
    """Run the scheduler for Kiln's periodic tasks (one per deployment)."""
    from kiln.app.observability import log_level
    from kiln.app.observability.logs import configure_logging
    from kiln.workers.celery.app import make_celery

    current = settings()
    level = log_level(current, loglevel)
    configure_logging(current.log_format, level)
    current.data_dir.mkdir(parents=True, exist_ok=True)
    schedule = current.data_dir / "beat-schedule"
    make_celery(current).Beat(loglevel=level, schedule=str(schedule)).run()
