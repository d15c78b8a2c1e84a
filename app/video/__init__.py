"""What a video is to Kiln, in one room shared by the API and the prep processes (which import
it from here; `kiln.app` never imports the workers):

- `container`: its bytes recognised by content, what its header claims, PyAV's container and
  video stream opened (or a sentence why not);
- `sampling`: a job's `video_fps`, the moments sampled, the limits, a sampled frame's key;
- `index`: its packets read into every frame's time and the keyframes;
- `reader`: a frame by presentation time — seek, decode, and the corrupt-frame rule (a frame
  that did not decode cleanly fails with a sentence, never shown as its neighbour).

The API refuses at submission what an upload's header already tells and draws a frame's
thumbnail with the reader; a prep process plans a video's frames from its index and decodes
them with the same reader, so a frame the worker fails is never drawn.
"""

from kiln.app.video.container import (
    HEAD_BYTES,
    Header,
    container_of,
    open_container,
    own_fps,
    read_header,
    video_stream,
)
from kiln.app.video.index import EPS, VideoIndex, read_index
from kiln.app.video.reader import VideoReader
from kiln.app.video.sampling import (
    DEFAULT_FPS,
    FPS_OPTION,
    FRAGMENT,
    MAX_FPS,
    Sampling,
    VideoLimits,
    check_fps,
    frame_key,
    refusal,
    sample_count,
    sample_times,
    split_key,
)

__all__ = [
    "DEFAULT_FPS",
    "EPS",
    "FPS_OPTION",
    "FRAGMENT",
    "HEAD_BYTES",
    "MAX_FPS",
    "Header",
    "Sampling",
    "VideoIndex",
    "VideoLimits",
    "VideoReader",
    "check_fps",
    "container_of",
    "frame_key",
    "open_container",
    "own_fps",
    "read_header",
    "read_index",
    "refusal",
    "sample_count",
    "sample_times",
    "split_key",
    "video_stream",
]
