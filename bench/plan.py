"""How big a run is: presets for the full benchmark, `--quick`, and the CI smoke test."""

from __future__ import annotations

from dataclasses import dataclass, replace

# In run order. Cases marked paired get a short raw-engine run just before them, so each
# ratio compares two measurements taken seconds apart on the same (noisy, shared) machine.
MODEL_CASES = ("raw", "loop", "embedded", "services", "naive-celery", "ray", "daft")
PAIRED = {"loop", "embedded", "services", "naive-celery", "ray", "daft"}
GLOBAL_CASES = (
    "startup",
    "ceiling",
    "ceiling-local",
    "streaming",
    "builtin",
    "bigjob",
    "feed",
    "standin",
    "video",
)
ALL_CASES = MODEL_CASES + GLOBAL_CASES
SERVICE_CASES = {"services", "naive-celery", "ray", "daft", "ceiling", "streaming", "builtin"}
SERVICE_CASES |= {"ceiling-local", "bigjob", "feed"}  # feed: a local deployment beside the stack
SERVICE_CASES |= {"standin"}  # its worker subject: a local deployment too
# The detector is Kiln's built-in YOLOv8n (320), submitted by name; the ResNets are exported here.
MODELS = ("resnet18", "resnet50", "detector")


@dataclass(frozen=True)
class Plan:
    images: int = 2000
    size: tuple[int, int] = (640, 480)
    models: tuple[str, ...] = MODELS
    cases: tuple[str, ...] = ALL_CASES
    ceiling_items: int = 5000
    ceiling_size: tuple[int, int] = (64, 64)
    ceiling_local_items: int = 4000  # uploaded over HTTP as multipart jobs of 1,000
    bigjob_items: int = 1_000_000
    bigjob_seconds: float = 30.0  # the window in which chunks finish and GETs are timed
    bigjob_workers: int = 3
    feed_images: int = 4000  # 640×480 JPEGs of the `feed` case; each subject also runs half
    # `standin` (the device stand-in): feed's JPEGs, each subject over half and all of these;
    # `kiln run` for every model here, a warm `kiln worker` for the first
    standin_images: int = 6000
    standin_models: tuple[str, ...] = ("resnet50", "detector")
    stream_seconds: float = 20.0
    # `video` (bench/video.py): a 1280×720, 30 fps H.264 clip this long; the detector at every
    # frame gets a clip of its own, shorter (20–30 frames/s on two cores)
    video_seconds: float = 600.0
    detector_every_frame_seconds: float = 60.0
    video_size: tuple[int, int] = (1280, 720)
    idle_samples: int = 30
    # `startup`: `kiln run --help` and a prep process's start this many times each (medians),
    # and a `kiln run` of the null model over this many images, once on a new data dir and
    # `startup_kiln_runs` times after it
    startup_runs: int = 5
    startup_images: int = 32
    startup_kiln_runs: int = 3
    builtin_items: int = 200  # per built-in model
    raw_seconds: float = 4.0
    sweep_seconds: float = 1.0
    # The raw engine's batch sizes, each with and without spinning threads; every one costs a
    # warm-up call and `sweep_seconds` (at least one call: 32 images of ResNet-18 take seconds).
    sweep_batches: tuple[int, ...] = (1, 4, 8, 16, 32)
    paired_seconds: float = 3.0
    # KILN_* settings for every Kiln process. The content cache is off: the cases resubmit the same
    # images (warm-up, streaming), and a cache hit would measure a lookup, not the engine.
    kiln_env: tuple[tuple[str, str], ...] = (("KILN_CONTENT_CACHE", "false"),)

    def with_(self, **changes: object) -> Plan:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def needs_stack(self) -> bool:
        return bool(SERVICE_CASES & set(self.cases))


PRESETS = {
    "default": Plan(),
    "quick": Plan(
        images=300,
        models=("resnet18",),
        ceiling_items=1500,
        bigjob_seconds=20.0,
        feed_images=1200,
        standin_images=1500,
        stream_seconds=6.0,
        video_seconds=20.0,
        detector_every_frame_seconds=10.0,
        idle_samples=15,
        startup_runs=3,
        startup_kiln_runs=2,
        builtin_items=60,
        raw_seconds=2.0,
        sweep_seconds=0.4,
        paired_seconds=1.5,
    ),
    "smoke": Plan(
        # not `video`: tests/bench/test_video_case.py runs it end to end on a tiny clip
        cases=tuple(c for c in ALL_CASES if c != "video"),
        images=12,
        size=(96, 72),
        models=("resnet18",),
        ceiling_items=40,
        ceiling_local_items=40,
        bigjob_items=2000,
        bigjob_seconds=3.0,
        feed_images=16,
        standin_images=64,
        standin_models=("resnet18",),  # exported for the other cases already
        stream_seconds=2.0,
        idle_samples=3,
        startup_runs=2,
        startup_kiln_runs=1,
        builtin_items=4,
        raw_seconds=0.3,
        sweep_seconds=0.1,
        sweep_batches=(1, 4),  # the same sweep (each setting, the best one taken), smaller
        paired_seconds=0.2,
    ),
}
