"""The GPU's JPEG decoders, and which one a worker uses (`KILN_JPEG_DECODER`).

- `nvimgcodec`: NVIDIA nvImageCodec (`nvidia-nvimgcodec-cu13`, the `gpu` extra; the GPU bundle's
  `decoder` part). Batched; its state lives in a decoder object, and each thread here has its
  own, so decode threads run at once. Its backends: the hardware JPEG engines (NVJPG, on A100,
  H100, H200…) for what they can take, nvJPEG's CUDA decoder for the rest.
- `torchvision`: torchvision's batched `decode_jpegs_cuda`: one nvJPEG decoder per process
  behind a mutex, synchronising at each batch, so threads take turns (`concurrent` False).

Each decodes on the calling thread's current CUDA stream and gives, per JPEG, an upright-as-
stored CHW uint8 tensor on the device, or None where it refused the image (Pillow decodes it
then: `device_pixels`). A JPEG is any buffer (bytes, or a memoryview of shared memory). A
tensor given back may be a view of the decoder's own memory, alive while the tensor is: the
caller copies it (`device_pixels.decode_groups` stacks each size) on the same stream before
it crosses to another. Each torch call releases the GIL, which the engine's process pays for
(issue 38): torchvision's takes the batch in three (`joined`: its bytes as one tensor, a view
per JPEG), nvImageCodec's in two per image (its images come one DLPack capsule each).
`torch`, `torchvision` and nvImageCodec are imported inside functions.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

# The order `auto` tries them in: the faster first (H200, 2026-11-27: torchvision 22.8k
# images/s, nvImageCodec 10.9k with the hardware engines; docs/gpu.md).
DECODERS = ("torchvision", "nvimgcodec")
# What torchvision's decoders raise (TORCH_CHECK: RuntimeError; TORCH_CHECK_VALUE: ValueError).
DECODE_ERRORS = (RuntimeError, ValueError)
RGB = 3  # torchvision's ImageReadMode.RGB, as its image library's ops take it
Sizes = Sequence[tuple[int, int]]  # per JPEG, (height, width) as stored


class JpegDecoder(Protocol):
    name: str
    concurrent: bool  # whether threads may decode at once (each with its own state)
    wants_sizes: bool  # whether `decode` should be given the JPEGs' sizes (`sizes`)

    def decode(
        self, datas: Sequence[bytes | memoryview], device: Any, sizes: Sizes | None = None
    ) -> list[Any | None]:
        """Per JPEG a CHW uint8 tensor on `device` (orientation as stored), or None. `sizes`:
        each JPEG's (height, width) as stored, where prep read its header already — for a
        decoder that must know them before it decodes (the device stand-in's); the GPU's
        own read them from the bytes as they decode."""
        ...


class TorchvisionJpeg:
    """torchvision's batched nvJPEG op. It gives no partial results: after a failure each
    image is tried alone, and those it refuses come back None."""

    name = "torchvision"
    concurrent = False  # one process-wide decoder behind a mutex
    wants_sizes = False

    def __init__(self, op: Callable[[list[Any], Any], list[Any]]) -> None:
        self._op = op

    def decode(
        self, datas: Sequence[bytes | memoryview], device: Any, sizes: Sizes | None = None
    ) -> list[Any | None]:
        import torch

        settle(torch, device)
        encoded = joined(torch, datas)
        return batch_or_alone(lambda some: self._op(some, device), encoded, DECODE_ERRORS)


def joined(torch: Any, datas: Sequence[bytes | memoryview]) -> list[Any]:
    """The JPEGs as 1-D uint8 host tensors, as torchvision's op takes them: one copy of the
    batch's bytes, one tensor over it, one view per JPEG (three torch calls, not one per
    JPEG: each releases the GIL)."""
    if not datas:
        return []
    lengths = [memoryview(data).nbytes for data in datas]
    flat = torch.frombuffer(bytearray().join(datas), dtype=torch.uint8)  # writable: no copy
    return list(torch.split(flat, lengths))


class NvImageCodecJpeg:
    """nvImageCodec, one decoder per thread (its buffers and nvJPEG states are the thread's).
    `backends`: nvImageCodec's backend kinds to allow (None: all, hardware first)."""

    name = "nvimgcodec"
    concurrent = True
    wants_sizes = False

    def __init__(self, module: Any, device_id: int, backends: Sequence[str] | None = None) -> None:
        self._nvimgcodec = module
        self._device_id = device_id
        self._backends = (
            None
            if backends is None
            else [module.Backend(getattr(module.BackendKind, b)) for b in backends]
        )
        # RGB like libjpeg; EXIF left to `device_pixels.orient`, as for every other decoder
        self._params = module.DecodeParams(
            color_spec=module.ColorSpec.SRGB, apply_exif_orientation=False
        )
        self._local = threading.local()

    def _decoder(self) -> Any:
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            # fancy upsampling: chroma as libjpeg (and so Pillow, the CPU path) upsamples it
            decoder = self._local.decoder = self._nvimgcodec.Decoder(
                device_id=self._device_id, backends=self._backends,
                options=":fancy_upsampling=1",
            )  # fmt: skip
        return decoder

    def decode(
        self, datas: Sequence[bytes | memoryview], device: Any, sizes: Sizes | None = None
    ) -> list[Any | None]:
        import torch

        settle(torch, device)
        # nvImageCodec raises its own errors (not torch's): any refusal sends the batch's
        # images one by one, and one it refuses alone to the CPU, which decodes it or says why
        return batch_or_alone(lambda some: self._decode(torch, some, device), datas, (Exception,))

    def _decode(
        self, torch: Any, datas: Sequence[bytes | memoryview], device: Any
    ) -> list[Any | None]:
        module = self._nvimgcodec
        stream = torch.cuda.current_stream(device)
        sources = [module.CodeStream(bytes(data)) for data in datas]
        # the GIL is released while it decodes; outputs are ordered on `stream`
        images = self._decoder().decode(
            sources, params=self._params, cuda_stream=stream.cuda_stream
        )
        return [None if image is None else _chw(torch, image) for image in images]


def batch_or_alone(
    decode: Callable[[list[Any]], Sequence[Any]],
    items: Sequence[Any],
    errors: tuple[type[BaseException], ...],
) -> list[Any | None]:
    """`decode(items)`; when it raises one of `errors` (a batched decoder gives no partial
    results), each item alone, None for each it refuses."""
    try:
        return list(decode(list(items)))
    except errors:
        pass
    alone: list[Any | None] = []
    for item in items:
        try:
            alone.append(decode([item])[0])
        except errors:
            alone.append(None)
    return alone


def settle(torch: Any, device: Any) -> None:
    """Wait, on the host, for what this thread's stream has queued (the last batch's EXIF
    turns and copies). The decoders write their outputs from streams of their own, which do
    not wait for ours, into memory the caching allocator may just have handed back from a
    tensor our queued kernels still read (torchvision allocates on our stream, writes on its
    own; nvJPEG's hardware decode orders its writes by itself)."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _chw(torch: Any, image: Any) -> Any:
    """An nvImageCodec image as a CHW tensor over its memory (the tensor keeps the image
    alive). nvImageCodec frees that memory on the decoding stream when the image goes, which
    a later stage's stream would not wait for: the caller's stack copies it first, on the
    decoding stream (`device_pixels.decode_groups`), so it never crosses."""
    return torch.from_dlpack(image).permute(2, 0, 1)


@functools.cache
def jpeg_decoder(choice: str = "auto", device: str = "cuda") -> JpegDecoder | None:
    """The decoder `choice` names (`auto`: the first of DECODERS that decodes a JPEG here),
    or None: no GPU decoder (the prep processes decode)."""
    names = DECODERS if choice == "auto" else (choice,)
    for name in names:
        decoder = _make(name, device)
        if decoder is not None and _works(decoder, device):
            log.info("JPEGs decode on the GPU with %s", decoder.name)
            return decoder
    return None


def _make(name: str, device: str) -> JpegDecoder | None:
    if name == "nvimgcodec":
        module = nvimgcodec_module()
        if module is None:
            return None
        import torch

        index = torch.device(device).index
        return NvImageCodecJpeg(module, torch.cuda.current_device() if index is None else index)
    if name == "torchvision":
        op = torchvision_op()
        return None if op is None else TorchvisionJpeg(op)
    raise ValueError(f"Unknown JPEG decoder {name!r}; use auto, {', '.join(DECODERS)}.")


def _works(decoder: JpegDecoder, device: str) -> bool:
    """A tiny JPEG through it: a decoder whose libraries are missing fails here, not mid-job."""
    import io

    import torch
    from PIL import Image

    if not torch.cuda.is_available():
        return False
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 100, 50)).save(buffer, "JPEG")
    try:
        decoded = decoder.decode([buffer.getvalue()], device)
    except Exception as error:  # a library missing or refusing the card: the next one
        log.info("the %s JPEG decoder does not work here: %s", decoder.name, error)
        return False
    return decoded[0] is not None and tuple(decoded[0].shape) == (3, 8, 8)


def nvimgcodec_module() -> Any | None:
    """nvImageCodec, its nvJPEG loaded first: the extension opens `libnvjpeg.so.13` by name,
    which pip's `nvidia-nvjpeg` puts where the loader does not look (`nvidia/cu13/lib`)."""
    _preload(NVJPEG)
    try:
        from nvidia import nvimgcodec
    except (ImportError, OSError):
        return None
    return nvimgcodec


NVJPEG = ("libnvjpeg.so.13", "libnvjpeg.so.12")
_LIB_FOLDERS = ("nvidia/cu13/lib", "nvidia/nvjpeg/lib")


@functools.cache
def _preload(names: tuple[str, ...]) -> str | None:
    """The first of `names` found under a `sys.path` entry's pip CUDA folders, loaded
    globally (so a later dlopen by name finds it); None when none is there (the system's
    loader path may still have it)."""
    import ctypes
    import sys

    for entry in sys.path:
        for folder in _LIB_FOLDERS:
            for name in names:
                path = Path(entry or ".") / folder / name
                if path.is_file():
                    try:
                        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                    except OSError:
                        continue
                    return str(path)
    return None


def torchvision_op() -> Callable[[list[Any], Any], list[Any]] | None:
    """torchvision's batched nvJPEG op (`image::decode_jpegs_cuda`), loaded from its image
    library without importing the torchvision package: that import costs seconds and pulls
    torch._dynamo and sympy into the worker (docs/gpu.md). If the library cannot be loaded
    alone, the public `decode_jpeg`; None without either."""
    import torch

    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):  # a stand-in module without a spec
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for library in sorted(p for f in folders for p in Path(f).glob("image*.so")):
        try:
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
            op = torch.ops.image.decode_jpegs_cuda
        except (OSError, RuntimeError, AttributeError):
            break
        return lambda encoded, device: list(op(encoded, RGB, torch.device(device)))
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except (ImportError, OSError):  # no torchvision, or one built without its image library
        return None
    return lambda encoded, device: list(decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device))
