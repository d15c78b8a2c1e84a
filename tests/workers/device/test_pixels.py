"""Device-side image preprocessing (`device_pixels`) against the CPU predictor it stands in for.

torch runs in one child process only (as in test_torch_engine): this process stays torch-free,
like a worker. The child decodes every image with `decode_groups` on the CPU (so every image
takes the Pillow fallback: nvJPEG needs CUDA and torchvision, neither here) and fits and
fits it with `fit_batch` (uint8 NHWC, the engines' contract) and normalises it as the torch
engine does; this process feeds the same bytes to the real predictors
(their prep, then the engine's `normalize` seen through an identity model) and compares.
The nvJPEG path itself has not run here.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from devstack.images import photo, truncated_jpeg
from kiln.app.catalog.model_spec import ImageModelSpec, Preprocessing
from kiln.app.core.errors import InputError
from kiln.workers.device import decoders
from kiln.workers.device.decoders import TorchvisionJpeg
from kiln.workers.device.pixels import supports
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.models.classify import ClassifyPredictor
from kiln.workers.models.detect import YoloPredictor
from kiln.workers.models.image_model import ImageModelPredictor
from kiln.workers.prep.header import Header, read_header
from kiln.workers.prep.images import placement_row
from kiln.workers.prep.pixels import Decoded, Letterbox, Squash, decode_image, fit_image, fit_size
from tests.support import loads_no_torch, run_torch_child
from tests.workers.models.halves import batch_of, prepare
from tests.workers.models.yolo import identity_model

MAX_PIXELS = 10_000_000

# Tolerances, in pixel levels (0-255) of the fitted image, from the differences measured over
# the images and fits below. Against Pillow's full path (a full decode, resized whole): bilinear
# and bicubic max 2 levels, mean <= 0.05 (torch's antialiased kernels are Pillow's, run in
# float; each pass is rounded and clipped to uint8 as Pillow does); nearest exact upscaling,
# at two scales here a few pixels differ (max 59 levels, mean 0.054): a sample point on a
# rounding edge picks the neighbour.
FULL_MAX, FULL_MEAN, NEAREST_DOWN_MEAN = 2, 0.1, 0.1
# Against the CPU predictor where it did not draft: max 5, mean <= 0.05 (its JPEG crop resamples
# only the kept square, a box a fraction of a pixel away). Where it drafted (a JPEG decoded at
# 1/2-1/8 DCT scale, the device decoding in full): max 153 levels at edges, mean <= 2.3.
PREDICTOR_MAX, PREDICTOR_MEAN, DRAFTED_MEAN = 6, 0.1, 2.5

CHILD = """
import sys
from tests.workers.device.test_pixels import run_torch
run_torch(sys.argv[1])
"""


# --- the inputs (this process) ------------------------------------------------------------


def noise_png(size: tuple[int, int]) -> bytes:
    """Random pixels: the worst case for resampling differences."""
    pixels = np.random.default_rng(3).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "PNG")


def grey_png() -> bytes:
    gradient = np.tile(np.arange(0, 250, 2, dtype=np.uint8), (90, 1))  # 125 × 90
    return encode(Image.fromarray(gradient, "L"), "PNG")


def rotated_jpeg() -> bytes:
    """Stored 400 × 300 with EXIF orientation 6: upright it is 300 × 400."""
    image = Image.open(io.BytesIO(photo(6, (400, 300))))
    exif = image.getexif()
    exif[0x0112] = 6
    return encode(image, "JPEG", exif=exif.tobytes())


def encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


IMAGES = {
    "jpeg-down": photo(1, (640, 480)),
    "jpeg-up": photo(2, (120, 90)),
    "png-up": photo(3, (150, 100), "PNG"),
    "png-portrait": photo(4, (300, 500), "PNG"),
    "noise-png": noise_png((200, 150)),
    "grey-png": grey_png(),
    "exif-jpeg": rotated_jpeg(),
}
DRAFTED = {"jpeg-draft": photo(5, (1600, 1200))}  # the CPU path drafts this one for every fit

# (family, spec fields): one predictor per fit, with its normalisation options varied.
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "crop-bilinear": ("classify", {"input_size": 224}),
    "crop-bicubic": ("classify", {"input_size": 224, "resize_filter": "bicubic"}),
    "squash": (
        "detect",
        {
            "input_size": 256,
            "fit": "squash",
            "channel_order": "BGR",
            "pixel_range": "0-255",
            "layout": "NHWC",
            "mean": (100.0, 110.0, 120.0),
            "std": (50.0, 60.0, 70.0),
        },
    ),
    "letterbox": ("detect", {"input_size": 320}),
    "squash-nearest": ("classify", {"input_size": 96, "fit": "squash", "resize_filter": "nearest"}),
}

BAD = {
    "not-an-image": b"not an image at all",
    "truncated": truncated_jpeg(),
    "empty": b"",
}


# --- the child (torch) --------------------------------------------------------------------


def run_torch(where: str) -> None:
    """decode_groups + fit_batch for every spec; the fitted pixels, the normalised batch and
    the metas; then the error, orientation and engine checks."""
    import torch

    from kiln.workers.device import pixels as di
    from kiln.workers.engines.uint8_input import Normalization, TorchNormalization

    folder = Path(where)
    listing = json.loads((folder / "cases.json").read_text())
    datas = [(folder / f"{name}.img").read_bytes() for name in listing["images"]]
    images = decode_batch(datas, "cpu", max_pixels=MAX_PIXELS)
    report: dict[str, Any] = {"decoded": [list(t.shape) for t in images], "metas": {}}
    for name, fields in listing["specs"].items():
        pre = preprocessing(fields)
        pixels = torch.stack([di.fit_on_device(image, pre)[0] for image in images])
        batch, metas = di.fit_batch(images, pre)  # grouped by size: one resize per group
        normalise = TorchNormalization(Normalization.of(pre), "cpu", torch.float32)
        np.savez(folder / f"{name}.out.npz", pixels=pixels.to(torch.uint8).permute(0, 2, 3, 1),
                 batched=batch.numpy(), normalised=normalise(batch).contiguous().numpy(),
                 contiguous=np.array(batch.is_contiguous()))  # fmt: skip
        report["metas"][name] = [describe(meta) for meta in metas]
    report["bad"] = decode_errors(folder, listing["bad"])
    report["capped"] = str(decode_batch([datas[0]], "cpu", max_pixels=1000)[0])
    report["empty"] = list(di.fit_batch([], preprocessing(listing["specs"]["letterbox"]))[0].shape)
    report["orientations"] = orientations_match()
    report["engine"] = engine_checks(folder)
    report["routed"] = routed_through_a_stand_in(folder)
    report["frame"] = a_decoded_frame_travels_as_pixels(folder)
    # Where torchvision does not import, nvJPEG declines every image (they go to Pillow).
    sys.modules["torchvision"] = None  # type: ignore[assignment]
    report["no_torchvision"] = decoders.torchvision_op() is None
    (folder / "report.json").write_text(json.dumps(report))


def decode_batch(datas: list[Any], device: Any, **options: Any) -> list[Any]:
    """`decode_groups` image by image, in the order given."""
    from kiln.workers.device import pixels as di

    return di.by_row(*di.decode_groups(datas, device, **options), len(datas))


def preprocessing(fields: dict[str, Any]) -> Preprocessing:
    return Preprocessing(**{**fields, "mean": tuple(fields["mean"]), "std": tuple(fields["std"])})


def describe(meta: dict[str, Any]) -> dict[str, Any]:
    return {key: [type(value).__name__, asdict(value)] for key, value in meta.items()}


def decode_errors(folder: Path, names: list[str]) -> list[str | list[int]]:
    """A batch of good and bad images: each bad one is its own error, the good ones decode."""
    good = (folder / "png-up.img").read_bytes()
    batch = [good] + [(folder / f"{name}.img").read_bytes() for name in names] + [good]
    results = decode_batch(batch, "cpu", max_pixels=MAX_PIXELS)
    return [str(r) if isinstance(r, InputError) else list(r.shape) for r in results]


def a_decoded_frame_travels_as_pixels(folder: Path) -> list[Any]:
    """A video frame (decoded in prep, HWC RGB) beside an image's bytes in one batch: it is
    the device's CHW tensor of those very pixels; the image decodes as ever."""
    from kiln.workers.device import pixels as di

    good = (folder / "png-up.img").read_bytes()
    frame = np.random.default_rng(7).integers(0, 256, (36, 64, 3), dtype=np.uint8)
    header = di.read_header(good, max_pixels=MAX_PIXELS)
    image, pixels = decode_batch([good, frame], "cpu", max_pixels=MAX_PIXELS,
                                    headers=[header, None])  # type: ignore[list-item]  # fmt: skip
    same = bool(np.array_equal(pixels.permute(1, 2, 0).numpy(), frame))
    return [list(image.shape), list(pixels.shape), same]


def orientations_match() -> dict[str, bool]:
    """`orient` on the stored pixels equals Pillow's `exif_transpose`, for all 8 orientations."""
    import torch
    from PIL import ImageOps

    from kiln.workers.device.pixels import orient

    stored = np.random.default_rng(5).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    found = {}
    for orientation in range(1, 9):
        image = Image.fromarray(stored)
        image.getexif()[0x0112] = orientation
        upright = np.asarray(ImageOps.exif_transpose(image))
        ours = orient(torch.from_numpy(stored.copy()).permute(2, 0, 1), orientation)
        found[str(orientation)] = bool(np.array_equal(ours.permute(1, 2, 0).numpy(), upright))
    return found


def routed_through_a_stand_in(folder: Path) -> dict[str, Any]:
    """The nvJPEG route's own logic (which images go, the retry one by one after a failed
    batch, orientation, the Pillow fallback) with a stand-in for torchvision's batched op
    that decodes with Pillow as nvJPEG does (EXIF not applied) and refuses the 120 px wide
    image. The real nvJPEG has not run here."""
    import torch

    calls: list[int] = []

    def one(data: Any, device: Any) -> Any:
        image = Image.open(io.BytesIO(data.numpy().tobytes()))
        if image.width == 120:
            raise RuntimeError("nvjpegDecode failed: unsupported")
        return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).to(device)

    def decode_jpegs(data: list[Any], device: Any) -> list[Any]:
        calls.append(len(data))
        return [one(item, device) for item in data]

    names = ["jpeg-down", "png-up", "exif-jpeg", "not-an-image", "jpeg-up", "grey-png"]
    batch = [(folder / f"{name}.img").read_bytes() for name in names]
    stand_in = TorchvisionJpeg(decode_jpegs)
    routed = decode_batch(batch, "cpu", max_pixels=MAX_PIXELS, nvjpeg=True, decoder=stand_in)
    pillow = decode_batch(batch, "cpu", max_pixels=MAX_PIXELS)
    same = [
        str(a) == str(b) if isinstance(a, InputError) else bool(torch.equal(a, b))
        for a, b in zip(routed, pillow, strict=True)
    ]
    return {"calls": calls, "same": same}


def engine_checks(folder: Path) -> dict[str, Any]:
    """`TorchEngine.infer_tensors` gives what `infer` gives for the same feeds."""
    import torch

    from kiln.workers.engines.base import EngineRequest
    from kiln.workers.engines.torch_engine import build_torch_engine

    path = identity_model(folder / "identity.onnx", size=8)
    engine = build_torch_engine(EngineRequest("identity", path, 4), "cpu", 1)
    feeds = np.random.default_rng(2).uniform(-2, 2, (3, 3, 8, 8)).astype(np.float32)
    from_host = engine.infer({"images": feeds})["fed"]
    from_tensors = engine.infer_tensors({"images": torch.from_numpy(feeds.copy())})["fed"]
    try:
        engine.infer_tensors({"pixels": torch.from_numpy(feeds.copy())})
        wrong = ""
    except ValueError as error:
        wrong = str(error)
    return {"equal": bool(np.array_equal(from_host, from_tensors)), "wrong_name": wrong,
            "dtype": str(from_tensors.dtype)}  # fmt: skip


# --- this process: the CPU predictor and the comparisons ----------------------------------


def predictor(folder: Path, family: str, fields: dict[str, Any]) -> ImageModelPredictor:
    """The real predictor for this spec, on an identity engine: it returns what it is fed."""
    layout = str(fields.get("layout", "NCHW"))
    size = int(fields["input_size"])
    path = identity_model(folder / f"identity-{layout}-{size}.onnx", layout=layout, size=size)
    engine = OnnxRuntimeEngine(path, max_batch=16)
    stored = ImageModelSpec.from_dict({**fields, "labels": ["x"]}).stored(family)
    if family == "detect":
        return YoloPredictor("device", engine, stored, max_pixels=MAX_PIXELS)
    return ClassifyPredictor("device", engine, stored, max_pixels=MAX_PIXELS)


class TorchRun:
    def __init__(self, folder: Path, predictors: dict[str, ImageModelPredictor]) -> None:
        self.folder = folder
        self.predictors = predictors
        self.report: dict[str, Any] = json.loads((folder / "report.json").read_text())

    def outputs(self, spec: str) -> dict[str, np.ndarray]:
        return dict(np.load(self.folder / f"{spec}.out.npz"))


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> TorchRun:
    folder = tmp_path_factory.mktemp("device-images")
    for name, data in {**IMAGES, **DRAFTED, **BAD}.items():
        (folder / f"{name}.img").write_bytes(data)
    predictors = {name: predictor(folder, *spec) for name, spec in SPECS.items()}
    specs = {name: json_ready(asdict(p.pre)) for name, p in predictors.items()}
    listing = {"images": [*IMAGES, *DRAFTED], "specs": specs, "bad": list(BAD)}
    (folder / "cases.json").write_text(json.dumps(listing))
    run_torch_child(CHILD, folder)
    return TorchRun(folder, predictors)


def json_ready(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def levels(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    diff = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))
    return float(diff.max()), float(diff.mean())


def pillow_full(data: bytes, pre: Preprocessing) -> tuple[np.ndarray, bool]:
    """Pillow's fit from a full decode, resized whole (no draft, no crop shortcut), and
    whether the CPU predictor drafts this image (decodes it at a reduced DCT scale)."""
    full = decode_image(data, max_pixels=MAX_PIXELS)
    drafted = decode_image(data, max_pixels=MAX_PIXELS, draft_to=lambda w, h: fit_size(pre, w, h))
    whole = Decoded(full.image, full.width, full.height, jpeg=False)
    return fit_image(whole, pre)[0], drafted.image.size != (full.width, full.height)


@pytest.mark.parametrize("spec", list(SPECS))
def test_fit_matches_pillow_and_the_cpu_predictor(torch_run: TorchRun, spec: str) -> None:
    """Fitted pixels within the measured resampling differences; the normalised batch is the
    CPU predictor's arithmetic on those pixels (so it differs only by them)."""
    pipe, ours = torch_run.predictors[spec], torch_run.outputs(spec)
    names = list(IMAGES) + list(DRAFTED)
    datas = [(torch_run.folder / f"{n}.img").read_bytes() for n in names]
    prepared = [prepare(pipe, data) for data in datas]
    nearest = pipe.pre.resize_filter == "nearest"
    for i, (name, row) in enumerate(zip(names, prepared, strict=True)):
        assert row.slot is not None
        reference, drafted = pillow_full(datas[i], pipe.pre)
        full_max, full_mean = levels(ours["pixels"][i], reference)
        worst, mean = levels(ours["pixels"][i], row.slot)
        print(f"\n{spec} {name}: vs Pillow max {full_max:.0f} mean {full_mean:.3f}; "
              f"vs predictor (drafted {drafted}) max {worst:.0f} mean {mean:.3f}")  # fmt: skip
        if nearest:
            assert full_mean <= NEAREST_DOWN_MEAN, name
        else:
            assert full_max <= FULL_MAX and full_mean <= FULL_MEAN, name
        if drafted:
            assert mean <= DRAFTED_MEAN, name
        else:
            assert worst <= PREDICTOR_MAX and mean <= PREDICTOR_MEAN, name
    fed, failed = pipe._output(batch_of(prepared))  # the CPU predictor: prep, normalize, engine
    assert not failed
    assert ours["normalised"].shape == fed.shape and ours["normalised"].dtype == fed.dtype
    print(f"{spec} normalised: max |device - cpu| {np.abs(ours['normalised'] - fed).max():.4f}")
    # The same arithmetic on the same uint8 pixels gives the same floats.
    same = pipe._normalize(np, ours["pixels"])
    np.testing.assert_allclose(ours["normalised"], same, rtol=0, atol=1e-6)
    # Fitted a group of one size at a time, the batch is each image fitted alone, NHWC.
    np.testing.assert_array_equal(ours["batched"], ours["pixels"])
    assert ours["contiguous"]


def test_nearest_is_exact_at_these_scales(torch_run: TorchRun) -> None:
    """Both sample pixel centres: the same pixels unless a sample point sits on a rounding
    edge (jpeg-down, jpeg-draft: measured above)."""
    pipe, ours = torch_run.predictors["squash-nearest"], torch_run.outputs("squash-nearest")
    for i, name in enumerate(IMAGES):
        if name in ("jpeg-up", "png-up", "png-portrait", "noise-png", "grey-png"):
            reference, _ = pillow_full((torch_run.folder / f"{name}.img").read_bytes(), pipe.pre)
            assert np.array_equal(ours["pixels"][i], reference), name


@pytest.mark.parametrize("spec", list(SPECS))
def test_metas_are_what_prep_gives(torch_run: TorchRun, spec: str) -> None:
    """The fit each image gets on the device, as the batch's meta row records it (what the
    detector maps its boxes back with), is the row the CPU prep writes; a crop has none."""
    kinds = {"Letterbox": Letterbox, "Squash": Squash}
    names = list(IMAGES) + list(DRAFTED)
    pipe = torch_run.predictors[spec]
    for name, described in zip(names, torch_run.report["metas"][spec], strict=True):
        metas = {key: kinds[kind](**values) for key, (kind, values) in described.items()}
        assert set(metas) == ({"fit"} if pipe.pre.fit != "crop" else set()), name
        row = np.zeros(pipe.prep.meta_width, np.float32)
        if "fit" in metas:
            row[:] = placement_row(metas["fit"])  # as `_output_on_device` records it
        expected = prepare(pipe, (torch_run.folder / f"{name}.img").read_bytes())
        np.testing.assert_array_equal(row, expected.meta, err_msg=name)


def test_images_decode_upright_at_full_size(torch_run: TorchRun) -> None:
    sizes = {"jpeg-down": (640, 480), "png-portrait": (300, 500), "grey-png": (125, 90),
             "exif-jpeg": (300, 400), "jpeg-draft": (1600, 1200)}  # fmt: skip
    shapes = dict(zip([*IMAGES, *DRAFTED], torch_run.report["decoded"], strict=True))
    for name, (width, height) in sizes.items():
        assert shapes[name] == [3, height, width], name


def test_a_bad_image_is_its_own_error(torch_run: TorchRun) -> None:
    """Each bad image comes back as the sentence the CPU path gives for it; the batch's good
    images still decode."""
    expected = []
    for data in BAD.values():
        with pytest.raises(InputError) as caught:
            decode_image(data, max_pixels=MAX_PIXELS)
        expected.append(str(caught.value))
    assert torch_run.report["bad"] == [[3, 100, 150], *expected, [3, 100, 150]]
    assert torch_run.report["capped"] == (
        "The image is 640×480 pixels, over the limit of 1,000 pixels."
    )


def test_a_video_frame_decoded_in_prep_is_uploaded_as_is(torch_run: TorchRun) -> None:
    assert torch_run.report["frame"] == [[3, 100, 150], [3, 36, 64], True]


def test_an_empty_batch_has_the_models_shape(torch_run: TorchRun) -> None:
    assert torch_run.report["empty"] == [0, 320, 320, 3]


def test_orientation_matches_pillow(torch_run: TorchRun) -> None:
    assert torch_run.report["orientations"] == {str(o): True for o in range(1, 9)}


def test_the_engine_takes_tensors(torch_run: TorchRun) -> None:
    found = torch_run.report["engine"]
    assert found["equal"] and found["dtype"] == "float32"
    assert found["wrong_name"] == "The engine takes inputs ['images'], but was given ['pixels']."


def test_the_nvjpeg_route_falls_back_per_image(torch_run: TorchRun) -> None:
    """Three JPEGs go in one batched call; the stand-in refuses one, so each is tried alone
    (the batch call gives no partial results); every image ends as Pillow's decode would
    have it, upright, and the bad one as its own error."""
    routed = torch_run.report["routed"]
    assert routed["calls"] == [3, 1, 1, 1]  # the batch (which fails), then one by one
    assert routed["same"] == [True] * 6


def test_without_torchvision_every_image_falls_back(torch_run: TorchRun) -> None:
    assert torch_run.report["no_torchvision"] is True


def test_the_header_says_where_an_image_decodes() -> None:
    """Read on a task thread without torch: the upright size, the orientation, and whether
    nvJPEG may take it (a whole RGB or grey JPEG; CMYK, a JPEG cut short and every other
    format go to Pillow)."""
    with loads_no_torch():  # read on a task thread without torch
        cmyk = encode(Image.new("CMYK", (20, 10), (0, 50, 100, 0)), "JPEG")
        assert read_header(IMAGES["exif-jpeg"], max_pixels=MAX_PIXELS) == Header(300, 400, 6, True)
        assert read_header(IMAGES["png-up"], max_pixels=MAX_PIXELS) == Header(150, 100, 1, False)
        assert read_header(cmyk, max_pixels=MAX_PIXELS) == Header(20, 10, 1, False)
        # nvJPEG would decode a truncated JPEG, its missing rows grey: Pillow refuses it.
        assert read_header(BAD["truncated"], max_pixels=MAX_PIXELS) == Header(640, 480, 1, False)
        with pytest.raises(InputError, match="over the limit of 1,000 pixels"):
            read_header(IMAGES["jpeg-down"], max_pixels=1000)


def test_lanczos_stays_on_the_cpu() -> None:
    assert not supports(Preprocessing(input_size=224, resize_filter="lanczos"))
    assert supports(Preprocessing(input_size=224, resize_filter="bicubic"))


def test_the_header_reads_any_buffer_in_place() -> None:
    """Rows' bytes may be views of shared memory: a memoryview of a slice of a larger buffer
    gives the header bytes give, the JPEG's end marker found past zero padding of any length
    (read from the end a few KiB at a time), and a JPEG cut short still goes to Pillow."""
    jpeg, cut = IMAGES["exif-jpeg"], BAD["truncated"]
    padded = jpeg + b"\0" * 10_000
    shared = bytearray(b"x" * 7 + jpeg + b"y" * 5 + padded + cut)
    view = memoryview(shared)
    at_jpeg, at_padded = 7, 7 + len(jpeg) + 5
    at_cut = at_padded + len(padded)
    views = {
        "jpeg": view[at_jpeg : at_jpeg + len(jpeg)],
        "padded": view[at_padded : at_padded + len(padded)],
        "cut": view[at_cut:],
    }
    expected = {"jpeg": jpeg, "padded": padded, "cut": cut}
    for name, part in views.items():
        header = read_header(part, max_pixels=MAX_PIXELS)
        assert header == read_header(expected[name], max_pixels=MAX_PIXELS), name
    assert read_header(views["padded"], max_pixels=MAX_PIXELS).nvjpeg
    assert not read_header(views["cut"], max_pixels=MAX_PIXELS).nvjpeg


def test_a_decoder_is_given_each_jpegs_size_as_stored() -> None:
    """The stand-in's decoder makes its tensors by the headers' sizes: the header's upright
    size turned back where EXIF turns the image (the decoders leave EXIF be)."""
    from kiln.workers.device.pixels import _stored

    assert _stored(Header(width=640, height=480, orientation=1, nvjpeg=True)) == (480, 640)
    assert _stored(Header(width=480, height=640, orientation=6, nvjpeg=True)) == (480, 640)
    assert _stored(Header(width=20, height=50, orientation=3, nvjpeg=True)) == (50, 20)
