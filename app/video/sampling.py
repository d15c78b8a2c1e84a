"""Which moments of a video a job samples, and the limits a video must keep: a job's
`video_fps`, the moments k/fps, the refusal of a video over a limit (from its header at
submission, from its packets in a prep process), and the key of a sampled frame:
`<source>#t=<seconds>` (W3C Media Fragments, three decimals), `frame_key` and `split_key`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kiln.app.core.errors import InputError

FPS_OPTION = "video_fps"  # a job's option (and the CLI's --video-fps): frames per second sampled
DEFAULT_FPS = 1.0
MAX_FPS = 1000.0  # past this, keys three decimals apart could name the same frame
FRAGMENT = "#t="


@dataclass(frozen=True)
class VideoLimits:
    max_frames: int  # sampled frames per video (KILN_MAX_VIDEO_FRAMES)
    max_duration_s: float  # a longer video is refused (KILN_MAX_VIDEO_DURATION_S)


@dataclass(frozen=True)
class Sampling:
    """How a job samples the videos among its inputs."""

    fps: float  # frames per second of video time; 0: every frame
    limits: VideoLimits


def check_fps(value: object) -> float:
    """A job's `video_fps`, or an InputError with a sentence that echoes it as given."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InputError(f"video_fps must be a number of frames per second, not {value!r}.")
    try:
        fps = float(value)
    except ValueError:
        raise InputError(
            f"video_fps must be a number of frames per second, not {value!r}."
        ) from None
    if not math.isfinite(fps) or fps < 0 or fps > MAX_FPS:
        raise InputError(
            f"video_fps must be between 0 (every frame) and {MAX_FPS:g} frames per second, "
            f"not {_as_given(value)}."
        )
    return fps


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _as_given(value: int | float | str) -> str:
    """A number as the user wrote it: a form field's "-1" is -1, not '-1' (nor -1.0)."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return value.strip()
    return repr(value)


def sample_count(duration_s: float, fps: float) -> int:
    """Frames sampled at `fps` from a video this long: one at each k/fps before its end."""
    return max(1, math.ceil(duration_s * fps - 1e-9))


def sample_times(duration_s: float, fps: float) -> list[float]:
    """The moments sampled at `fps` > 0 (every frame, fps 0, is the video's own times)."""
    if fps <= 0:
        raise ValueError("sample_times takes a rate above 0; every frame has no grid.")
    return [k / fps for k in range(sample_count(duration_s, fps))]


def refusal(
    duration_s: float | None,
    frames: int | None,
    fps: float,
    limits: VideoLimits,
    sampled: int | None = None,
    own_fps: float | None = None,
) -> str | None:
    """Why a video whose header says it lasts `duration_s` (and holds `frames`, at `own_fps`
    frames per second) is refused at this sampling rate, or None. A sentence names the limit
    and how to change it. Sampling takes each frame at most once, so a rate above the video's
    own counts its frames; `sampled`: the frames a plan counted exactly, where one did."""
    if duration_s is not None and duration_s > limits.max_duration_s:
        return (
            f"The video's header says it lasts {duration_s:,.0f} s, over the "
            f"{limits.max_duration_s:,.0f} s limit (KILN_MAX_VIDEO_DURATION_S)."
        )
    if fps > 0 and duration_s is not None:
        if sampled is None:
            sampled = sample_count(duration_s, fps)
            if frames:
                sampled = min(sampled, frames)
            elif own_fps and own_fps > 0:  # a header that counts no frames: its rate
                sampled = min(sampled, sample_count(duration_s, own_fps))
        rate = f"{fps:g} frames per second"
    elif fps == 0 and frames:
        sampled, rate = frames, "every frame"
    else:
        return None
    if sampled > limits.max_frames:
        return (
            f"Sampling this {duration_s or 0:,.1f} s video at {rate} gives {sampled:,} frames, "
            f"over the {limits.max_frames:,} limit (KILN_MAX_VIDEO_FRAMES); lower video_fps."
        )
    return None


def frame_key(source_key: str, time_s: float) -> str:
    return f"{source_key}{FRAGMENT}{time_s:.3f}"


def split_key(key: str, frame_time_s: float | None) -> str:
    """The key of the file a row came from: a frame's key without its `#t=` fragment."""
    if frame_time_s is None:
        return key
    suffix = f"{FRAGMENT}{frame_time_s:.3f}"
    return key[: -len(suffix)] if key.endswith(suffix) else key
