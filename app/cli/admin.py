"""`kiln db`, `kiln keys`, `kiln tenants`, `kiln models`: the operator's commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kiln.app.cli.common import console, errors, fail, redact, session, settings
from kiln.app.core.errors import KilnError, plain_reason

db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants and the S3 buckets they may read.", no_args_is_help=True)
models_app = typer.Typer(help="Models a job can name.", no_args_is_help=True)
engines_app = typer.Typer(help="Inference engines (TensorRT plans).", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply database migrations (run once per release, before the API starts)."""
    from sqlalchemy.exc import OperationalError

    from kiln.app.db.migrate import describe, upgrade

    current = settings()
    where = redact(current.database_url)
    try:
        done = upgrade(current)
    except KilnError as error:
        raise fail(error) from None
    except OperationalError as error:  # no such database, refused, a wrong password
        sentence = f"The database at {where} cannot be reached: {plain_reason(error)}."
        raise fail(KilnError(sentence)) from None
    if done.applied:
        plural = "" if done.applied == 1 else "s"
        console.print(
            f"Upgraded the database at {where} from {describe(done.before)} to "
            f"{describe(done.after)}: {done.applied} migration{plural} applied.",
            soft_wrap=True,
        )
    else:
        console.print(
            f"The database at {where} is already at {describe(done.after)}; nothing to do.",
            soft_wrap=True,
        )


@db_app.command("recount")
def db_recount(
    job: Annotated[
        list[str] | None, typer.Argument(help="Jobs to check (default: every job).")
    ] = None,
    fix: Annotated[
        bool, typer.Option(help="Set counters that differ to the items' counts.")
    ] = False,
) -> None:
    """Check each job's kept counters against its items; exit 1 if any differ (and not --fix)."""
    from kiln.app.db.audit import recount_jobs

    with session() as db:
        report = recount_jobs(db, job or None, fix=fix)
    for job_id, missing in report.differing:
        console.print(f"job {job_id}: counters differ from the items by {missing}")
    verb = "fixed" if fix else "differ"
    console.print(f"{report.checked} jobs checked, {len(report.differing)} {verb}")
    if report.differing and not fix:
        raise typer.Exit(1)


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key acts for.")],
    bucket: Annotated[
        list[str] | None,
        typer.Option(help="Also let the tenant read this S3 bucket (repeatable)."),
    ] = None,
) -> None:
    """Create an API key; it is printed once and stored only as a hash."""
    from kiln.app.tenants.auth import create_key

    with session() as db:
        try:
            key = create_key(db, tenant, bucket or [])
        except KilnError as error:
            raise fail(error) from None
    errors.print(f"key {key.prefix} for tenant {tenant!r} (shown once):")
    console.print(key.secret)


@tenants_app.command("allow-bucket")
def tenants_allow(tenant: str, bucket: str) -> None:
    """Let TENANT name s3://BUCKET/… in jobs, bulk sources and outputs, schedules and models."""
    from kiln.app.tenants.tenants import allow_bucket

    with session() as db:
        try:
            added = allow_bucket(db, tenant, bucket)
        except KilnError as error:
            raise fail(error) from None
    console.print(f"tenant {tenant!r} may read bucket {bucket!r}" + ("" if added else " (already)"))


@tenants_app.command("deny-bucket")
def tenants_deny(tenant: str, bucket: str) -> None:
    """Take BUCKET off TENANT's list; jobs already submitted go on, new ones are refused."""
    from kiln.app.tenants.tenants import deny_bucket

    with session() as db:
        try:
            deny_bucket(db, tenant, bucket)
        except KilnError as error:
            raise fail(error) from None
    console.print(f"tenant {tenant!r} may no longer read bucket {bucket!r}")


@tenants_app.command("list")
def tenants_list() -> None:
    """Tenants with active keys or allowed buckets."""
    from kiln.app.tenants.tenants import list_tenants

    table = Table("tenant", "active keys", "buckets")
    with session() as db:
        for t in list_tenants(db):
            table.add_row(t.tenant, str(t.active_keys), ", ".join(t.buckets) or "(no S3 access)")
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(prefix: str) -> None:
    """Revoke a key by the 8-character prefix shown at creation (kiln_<prefix>_…)."""
    from kiln.app.tenants.auth import revoke_key

    with session() as db:
        try:
            revoke_key(db, prefix)
        except KilnError as error:
            raise fail(error) from None
    console.print(f"key {prefix} revoked")


_MEAN_HELP = (
    "Per-channel mean, in the model's channel order and pixel range "
    "(default: ImageNet's; 0,0,0 for detect)."
)
_FIT_HELP = (
    "crop (resize the short side to input-size / crop-ratio, keep the centre), squash or "
    "letterbox (default: crop; letterbox for detect)."
)


@models_app.command("add")
def models_add(
    name: str,
    onnx: Annotated[str, typer.Option(help="ONNX file: a local path or an s3:// URI.")],
    kind: Annotated[str, typer.Option(help="classify, embed or detect.")] = "classify",
    input_size: Annotated[int, typer.Option(help="Square input side in pixels.")] = 224,
    labels: Annotated[Path | None, typer.Option(exists=True, help="One label per line.")] = None,
    mean: Annotated[str | None, typer.Option(help=_MEAN_HELP)] = None,
    std: Annotated[
        str | None, typer.Option(help="Per-channel std (default: ImageNet's; 1,1,1 for detect).")
    ] = None,
    layout: Annotated[str, typer.Option(help="NCHW or NHWC.")] = "NCHW",
    fit: Annotated[str | None, typer.Option(help=_FIT_HELP)] = None,
    resize_filter: Annotated[
        str, typer.Option(help="bilinear, bicubic, lanczos or nearest.")
    ] = "bilinear",
    crop_ratio: Annotated[
        float, typer.Option(help="crop: the share of the resized short side kept.")
    ] = 0.875,
    channel_order: Annotated[str, typer.Option(help="RGB or BGR.")] = "RGB",
    pixel_range: Annotated[str, typer.Option(help="0-1 or 0-255, before mean and std.")] = "0-1",
    top_k: Annotated[int, typer.Option(help="Labels kept per image (classify).")] = 5,
    score_threshold: Annotated[float | None, typer.Option(help="detect; default 0.25.")] = None,
    iou_threshold: Annotated[float | None, typer.Option(help="detect: NMS; default 0.45.")] = None,
    max_boxes: Annotated[int | None, typer.Option(help="detect: per image; default 300.")] = None,
    refuse_below: Annotated[
        float | None, typer.Option(help="classify: refuse inputs whose top score is below it.")
    ] = None,
    max_batch: Annotated[int | None, typer.Option(help="Largest batch the model takes.")] = None,
    fp16: Annotated[bool, typer.Option(help="Store embeddings as float16 (embed).")] = False,
    tenant: Annotated[
        str, typer.Option(help="Only this tenant sees it (default: every tenant).")
    ] = "",
) -> None:
    """Register an ONNX model as the next version of NAME (stored, sha256-checked)."""
    from kiln.app.catalog.catalog import register_model
    from kiln.app.catalog.model_spec import ImageModelSpec
    from kiln.app.storage import open_store

    label_list = labels.read_text().splitlines() if labels else []
    try:
        spec = ImageModelSpec.from_dict(
            {
                "input_size": input_size,
                "labels": [x.strip() for x in label_list if x.strip()],
                "mean": None if mean is None else _triple(mean),
                "std": None if std is None else _triple(std),
                "layout": layout.upper(),
                "fit": fit,
                "resize_filter": resize_filter.lower(),
                "crop_ratio": crop_ratio,
                "channel_order": channel_order.upper(),
                "pixel_range": pixel_range,
                "top_k": top_k,
                "score_threshold": score_threshold,
                "iou_threshold": iou_threshold,
                "max_boxes": max_boxes,
                "refuse_below": refuse_below,
                "max_batch": max_batch,
                "fp16": fp16,
            }
        )
        current = settings()
        data = _read_onnx(onnx, current.max_model_bytes)
        with session() as db:
            info = register_model(
                db, open_store(current), tenant=tenant, name=name, data=data, kind=kind,
                spec=spec, source=onnx,
            )  # fmt: skip
    except KilnError as error:
        raise fail(error) from None
    console.print(f"model {info.ref} ({info.kind}) registered, sha256 {info.sha256}")


@models_app.command("list")
def models_list(
    tenant: Annotated[str, typer.Option(help="Show what this tenant sees.")] = "",
) -> None:
    """List built-in models and the latest version of each registered one."""
    from kiln.app.catalog.catalog import list_models

    table = Table("model", "kind", "input", "description")
    with session() as db:
        for m in list_models(db, tenant):
            table.add_row(m.ref, m.kind, m.input, m.description)
    console.print(table)


@models_app.command("export")
def models_export(
    model: Annotated[str, typer.Argument(help="The built-in model to export: text-embed.")],
) -> None:
    """Export a built-in model to ONNX once (needs the torch extra); workers then need no torch."""
    from kiln.app.storage import open_store
    from kiln.workers.models.text_embed import export_text_embed

    if model != "text-embed":
        raise fail(KilnError("Only text-embed is exported; the other built-ins ship ONNX files."))
    current = settings()
    try:
        where = export_text_embed(current, open_store(current))
    except KilnError as error:
        raise fail(error) from None
    console.print(f"text-embed exported to {where}")


@engines_app.command("build")
def engines_build(
    model: Annotated[str, typer.Argument(help="NAME or NAME:VERSION.")],
    tenant: Annotated[str, typer.Option(help="Whose model NAME is (default: shared).")] = "",
    precision: Annotated[str | None, typer.Option(help="auto, fp16 or fp32.")] = None,
) -> None:
    """Build the model's TensorRT engines on this GPU and upload them to the engine cache, so
    new workers download them instead of building."""
    from kiln.app.catalog.catalog import get_model
    from kiln.app.storage import open_store
    from kiln.workers.engines.select import EngineFactory
    from kiln.workers.models.loader import load_predictor

    current = settings().model_copy(update={"engine": "tensorrt"})  # no fallback here
    if precision is not None:
        current = current.model_copy(update={"precision": precision})
    try:
        engines = EngineFactory(current, open_store(current))
    except KilnError as error:
        raise fail(
            KilnError(f"TensorRT cannot run here ({error}); build on a GPU host with kiln[gpu].")
        ) from None
    try:
        with session() as db:
            info = get_model(db, model, tenant)
        load_predictor(info, engines).close()  # building the engines caches their plans
    except KilnError as error:
        raise fail(error) from None
    gpu = engines.host.gpus[0]
    plans = [k for k in engines.store.list(f"engines/tensorrt/{gpu.slug}/") if k.endswith(".plan")]
    console.print(f"{info.ref}: TensorRT plans for {gpu.name} in the engine cache:")
    for key in plans:
        console.print(f"  {engines.store.describe(key)}")


def _read_onnx(source: str, max_bytes: int) -> bytes:
    if source.startswith("s3://"):
        from kiln.app.storage.s3 import make_s3_client, read_object

        return read_object(make_s3_client(settings()), source, max_bytes)
    path = Path(source)
    if not path.is_file():
        raise KilnError(f"There is no file at {source}.")
    if path.stat().st_size > max_bytes:
        raise KilnError(f"{source} is over the {max_bytes:,}-byte limit (KILN_MAX_MODEL_BYTES).")
    return path.read_bytes()


def _triple(text: str) -> tuple[float, float, float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3:
        raise KilnError(f"{text!r} must be three comma-separated numbers.")
    return (values[0], values[1], values[2])


admin_app = typer.Typer(help="Operator settings: per-tenant defaults.", no_args_is_help=True)
tenant_app = typer.Typer(
    help="A tenant's defaults: its jobs' webhook when they name none.", no_args_is_help=True
)
admin_app.add_typer(tenant_app, name="tenant")

NotifyUrl = Annotated[
    str | None,
    typer.Option(
        "--notify",
        help="The webhook its jobs report to when they name none ('' clears it).",
    ),
]
NotifyEvents = Annotated[
    str | None,
    typer.Option(help="Which ends the default webhook reports: completed,failed,cancelled."),
]


Weight = Annotated[
    float | None,
    typer.Option(
        help="Its weight in the bulk queue's fair share (1 = equal; 2 = twice another's share "
        "while both have bulk work).",
    ),
]
Retention = Annotated[
    str | None,
    typer.Option(
        help='How long its jobs\' items and results are kept after they end ("7d", "12h", '
        "seconds; none: the deployment's KILN_RETENTION).",
    ),
]


@tenant_app.command("set")
def tenant_set(
    name: str,
    notify: NotifyUrl = None,
    notify_events: NotifyEvents = None,
    retention: Retention = None,
    weight: Weight = None,
) -> None:
    """Set NAME's defaults; an option left out keeps its value. A new default is one more
    parameter here and one more entry in `changes` (its column: app/tenants/defaults.py)."""
    from kiln.app.jobs.webhooks import check_url, parse_events
    from kiln.app.tenants.defaults import set_defaults
    from kiln.app.tenants.shares import check_weight

    if notify is None and notify_events is None and retention is None and weight is None:
        raise fail(ValueError("Name a setting to change (--notify, --retention, --weight)."))
    try:
        if notify:
            check_url(notify, settings().webhook_allow_private)
        changes = {
            "notify_url": notify,
            "notify_events": parse_events(notify_events) if notify_events else None,
            "retention_s": _retention(retention),
            "share_weight": check_weight(weight) if weight is not None else None,
        }
        with session() as db:
            set_defaults(db, name, changes)
    except KilnError as error:
        raise fail(error) from None
    tenant_show(name)


@tenant_app.command("show")
def tenant_show(name: str) -> None:
    """NAME's defaults (the deployment's where the operator set none)."""
    from kiln.app.jobs.webhooks import EVENTS
    from kiln.app.tenants.defaults import defaults_of
    from kiln.app.tenants.shares import DEFAULT_WEIGHT

    with session() as db:
        row = defaults_of(db, name)
    url = row.notify_url if row is not None else None
    events = (row.notify_events if row is not None else None) or list(EVENTS)
    own = row.retention_s if row is not None else None
    weight = row.share_weight if row is not None else DEFAULT_WEIGHT
    kept = _kept(own) if own is not None else f"the deployment's: {_kept(settings().retention)}"
    for line in (
        f"webhook {url} ({', '.join(events)})" if url else "no webhook",
        kept,
        f"fair-share weight {weight:g}",
    ):
        console.print(f"tenant {name!r}: {line}", soft_wrap=True)


def _retention(asked: str | None) -> int | str | None:
    """`--retention`'s column value: seconds, "" to clear it (`none`: the deployment's), or
    None when not given; a bad value raises with the sentence the API would give."""
    from kiln.app.core.durations import optional_duration
    from kiln.app.jobs.retention import check_retention

    if asked is None:
        return None
    try:
        if optional_duration(asked) is None:
            return ""
    except ValueError:
        pass  # not a word for "none": check_retention says what is wrong
    return check_retention(asked, settings(), "--retention")


def _kept(seconds: int | None) -> str:
    from kiln.app.core.durations import describe

    return "results kept for ever" if seconds is None else f"results kept {describe(seconds)}"
