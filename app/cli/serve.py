"""`kiln api`, `kiln worker`, `kiln flower`, `kiln beat`: the long-running processes."""

from __future__ import annotations

import os
import socket
from typing import Annotated

import typer

from app.cli.common import fail, settings
from app.core.errors import KilnError


def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Serve the HTTP API."""
    import uvicorn

    from app.api.app import create_app

    uvicorn.run(create_app(settings()), host=host, port=port, log_level="info")


def worker(
    concurrency: Annotated[int | None, typer.Option(help="Task threads.")] = None,
    queues: Annotated[
        str, typer.Option(help="Queues, highest priority first.")
    ] = "interactive,ingest,bulk,control",
    hostname: Annotated[str | None, typer.Option(help="Celery node name.")] = None,
    loglevel: Annotated[str, typer.Option(help="Log level.")] = "INFO",
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port.")
    ] = None,
    device: Annotated[
        int | None, typer.Option(help="Run on this GPU only (CUDA_VISIBLE_DEVICES).")
    ] = None,
    devices: Annotated[
        str | None, typer.Option(help="'all': one worker process per visible GPU.")
    ] = None,
) -> None:
    """Run a worker: task threads feed one Batcher per model; one process per GPU."""
    if devices is not None:
        raise typer.Exit(_fleet(devices, concurrency, queues, loglevel, metrics_port))
    if device is not None:
        from workers.device import pin

        pin(device)  # before anything imports CUDA: the engine is built later, in this process
    node = hostname or (f"gpu{device}@{socket.gethostname()}" if device is not None else None)
    _work(concurrency, queues, node or f"cpu@{socket.gethostname()}", loglevel, metrics_port)


def _work(
    concurrency: int | None, queues: str, node: str, loglevel: str, metrics_port: int | None
) -> None:
    from workers.celery_app import make_celery
    from workers.metrics import serve_metrics, worker_registry

    current = settings()
    celery = make_celery(current)
    celery.node_name = node
    port = metrics_port or current.worker_metrics_port
    if port:
        serve_metrics(port, worker_registry(celery))
    try:
        celery.Worker(
            pool_cls="threads",
            concurrency=concurrency or current.task_threads,
            queues=queues.split(","),
            hostname=node,
            loglevel=loglevel,
            send_events=True,
        ).start()
    finally:
        celery.close_runtime()


def _fleet(
    devices: str, concurrency: int | None, queues: str, loglevel: str, metrics_port: int | None
) -> int:
    from workers.device import list_gpus
    from workers.fleet import Fleet, child_args

    if devices != "all":
        raise fail(KilnError("--devices takes 'all'; use --device N for one GPU."))
    gpus = list_gpus()
    host = socket.gethostname()
    extra = ["--queues", queues, "--loglevel", loglevel]
    if concurrency:
        extra += ["--concurrency", str(concurrency)]
    if not gpus:
        typer.echo("no GPU visible (NVML): running one CPU worker", err=True)
        _work(concurrency, queues, f"cpu@{host}", loglevel, metrics_port)
        return 0
    port = metrics_port or settings().worker_metrics_port
    typer.echo(f"{len(gpus)} GPU(s): " + ", ".join(f"{g.index}: {g.name}" for g in gpus), err=True)
    return Fleet([child_args(g, host, extra, port) for g in gpus]).run()


def flower(port: Annotated[int, typer.Option(help="Port for the Flower UI.")] = 5555) -> None:
    """Flower against the configured broker; refuses to start without authentication."""
    from workers.celery_app import make_celery

    auth = os.environ.get("KILN_FLOWER_BASIC_AUTH")
    if not auth or ":" not in auth:
        raise fail(KilnError("Set KILN_FLOWER_BASIC_AUTH=user:password; Flower never runs open."))
    make_celery(settings()).start(["flower", f"--port={port}", f"--basic-auth={auth}"])


def beat(loglevel: Annotated[str, typer.Option(help="Log level.")] = "INFO") -> None:
    """Run the scheduler for Kiln's periodic tasks (one per deployment)."""
    from workers.celery_app import make_celery

    current = settings()
    current.data_dir.mkdir(parents=True, exist_ok=True)
    schedule = current.data_dir / "beat-schedule"
    make_celery(current).Beat(loglevel=loglevel, schedule=str(schedule)).run()
