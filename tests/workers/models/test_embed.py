"""The image embedder family, on small real ONNX embedders built here and run by ONNX Runtime."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from onnx import TensorProto, helper, numpy_helper

from devstack.images import photo, solid
from kiln.app.core.errors import InputError
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.direct import run_direct
from kiln.workers.models.embed import EmbedPredictor, fields, l2_normalize
from tests.support import migrated_settings
from tests.workers.models.halves import batch, outputs, prepare

DIM = 8
SIZE = 16


def embedder(
    path: Path, *, layout: str = "NCHW", weights: np.ndarray | None = None, half: bool = False
) -> Path:
    """Mean colour per channel → a linear map to DIM values (GlobalAveragePool + Gemm)."""
    if weights is None:
        weights = np.random.default_rng(0).normal(size=(DIM, 3)).astype(np.float32)
    nodes, image = [], "images"
    if half:  # a model that takes float16 input
        nodes.append(helper.make_node("Cast", [image], ["wide"], to=TensorProto.FLOAT))
        image = "wide"
    if layout == "NHWC":
        nodes.append(helper.make_node("Transpose", [image], ["nchw"], perm=[0, 3, 1, 2]))
        image = "nchw"
    nodes += [
        helper.make_node("GlobalAveragePool", [image], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "W", "B"], ["embedding"], transB=1),
    ]
    shape: list[str | int | None] = (
        ["N", 3, SIZE, SIZE] if layout == "NCHW" else ["N", SIZE, SIZE, 3]
    )
    element = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "embedder",
        [helper.make_tensor_value_info("images", element, shape)],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", DIM])],
        [
            numpy_helper.from_array(weights, "W"),
            numpy_helper.from_array(np.zeros(DIM, np.float32), "B"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.fixture
def engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EngineFactory:
    settings = migrated_settings(tmp_path, monkeypatch)
    return EngineFactory(settings, LocalStore.from_url(settings.storage_url))


def spec(**overrides: Any) -> dict[str, Any]:
    return {
        "input_size": SIZE,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "layout": "NCHW",
        "dim": DIM,
        **overrides,
    }


def predictor(engines: EngineFactory, path: Path, **overrides: Any) -> EmbedPredictor:
    engine = engines.build("embedder", path, max_batch=16)
    return EmbedPredictor("embedder", engine, spec(**overrides), max_pixels=10_000_000)


def embed(pipe: EmbedPredictor, images: list[bytes]) -> list[np.ndarray]:
    """Each image's vector, as the item's outputs give it (a list of floats)."""
    return [np.asarray(found["embedding"]) for found in outputs(pipe, images)]


def stored_type(pipe: EmbedPredictor) -> pa.DataType:
    """What the predictor's vectors are, as its answers hold them."""
    return pipe.infer(batch(pipe, IMAGES[:2])).columns["embedding"].type


IMAGES = [photo(seed, size=(64 + 16 * seed, 48 + 8 * seed)) for seed in range(6)]


def test_vectors_are_unit_length_float32(engines: EngineFactory, tmp_path: Path) -> None:
    pipe = predictor(engines, embedder(tmp_path / "e.onnx"))
    assert stored_type(pipe) == pa.list_(pa.float32())
    found = outputs(pipe, IMAGES)
    vectors = [np.asarray(f["embedding"]) for f in found]
    for vector in vectors:
        assert vector.shape == (DIM,)
        assert abs(float(np.linalg.norm(vector)) - 1) < 1e-5
    assert all(f["dim"] == DIM for f in found)
    assert not np.allclose(vectors[0], vectors[1])  # different pictures, different vectors


def test_a_vector_does_not_depend_on_its_batch(engines: EngineFactory, tmp_path: Path) -> None:
    pipe = predictor(engines, embedder(tmp_path / "e.onnx"))
    in_batch = embed(pipe, IMAGES)
    for image, batched in zip(IMAGES, in_batch, strict=True):
        (alone,) = embed(pipe, [image])
        np.testing.assert_allclose(alone, batched, atol=1e-4)


def test_float16_storage_when_asked(engines: EngineFactory, tmp_path: Path) -> None:
    path = embedder(tmp_path / "e.onnx")
    full = embed(predictor(engines, path), IMAGES)
    narrow_pipe = predictor(engines, path, fp16=True)
    assert stored_type(narrow_pipe) == pa.list_(pa.float16())
    half = embed(narrow_pipe, IMAGES)
    for wide, narrow in zip(full, half, strict=True):
        assert narrow.shape == (DIM,)
        assert (narrow.astype(np.float16) == narrow).all()  # float16 values
        np.testing.assert_allclose(narrow, wide, atol=1e-3)


def test_nhwc_layout_gives_the_same_vectors(engines: EngineFactory, tmp_path: Path) -> None:
    """The same weights behind an NHWC input (transposed in the graph) see the same pixels."""
    nchw = embed(predictor(engines, embedder(tmp_path / "a.onnx")), IMAGES)
    nhwc_path = embedder(tmp_path / "b.onnx", layout="NHWC")
    nhwc = embed(predictor(engines, nhwc_path, layout="NHWC"), IMAGES)
    np.testing.assert_allclose(np.stack(nhwc), np.stack(nchw), atol=1e-5)


def test_a_model_with_float16_input_is_fed_float16(engines: EngineFactory, tmp_path: Path) -> None:
    wide = embed(predictor(engines, embedder(tmp_path / "a.onnx")), IMAGES)
    narrow = embed(predictor(engines, embedder(tmp_path / "b.onnx", half=True)), IMAGES)
    np.testing.assert_allclose(np.stack(narrow), np.stack(wide), atol=2e-3)


def test_a_zero_output_stays_zero(engines: EngineFactory, tmp_path: Path) -> None:
    path = embedder(tmp_path / "e.onnx", weights=np.zeros((DIM, 3), np.float32))
    (vector,) = embed(predictor(engines, path), [solid((10, 20, 30))])
    assert np.array_equal(vector, np.zeros(DIM, np.float32))


def test_l2_normalize() -> None:
    """Squares that overflow float16 (or float32) do not; zero rows stay zero, no NaN."""
    expected = np.array([[0.6, 0.8], [0, 0], [0.6, 0.8]])
    half = np.array([[3.0, 4.0], [0.0, 0.0], [3e4, 4e4]], dtype=np.float16)
    np.testing.assert_allclose(l2_normalize(half), expected, atol=1e-3)
    single = np.array([[3.0, 4.0], [0.0, 0.0], [3e30, 4e30]], dtype=np.float32)
    np.testing.assert_allclose(l2_normalize(single), expected, atol=1e-6)
    assert l2_normalize(single).dtype == np.float32


def test_a_model_of_another_size_than_registered_is_refused(
    engines: EngineFactory, tmp_path: Path
) -> None:
    engine = engines.build("embedder", embedder(tmp_path / "e.onnx"), max_batch=4)
    with pytest.raises(ValueError, match="outputs 8 values per image, but was registered"):
        EmbedPredictor("embedder", engine, spec(dim=16), max_pixels=1_000_000)


def test_bad_inputs_are_input_errors(engines: EngineFactory, tmp_path: Path) -> None:
    pipe = predictor(engines, embedder(tmp_path / "e.onnx"))
    with pytest.raises(InputError, match="images, not text"):
        prepare(pipe, "a caption")
    with pytest.raises(InputError):
        prepare(pipe, b"not an image")
    caption, good, bad = run_direct(pipe, ["a caption", IMAGES[0], b"not an image"])
    assert isinstance(caption, InputError) and "images, not text" in str(caption)
    assert isinstance(good, dict) and len(good["embedding"]) == DIM  # beside them, unharmed
    assert isinstance(bad, InputError)


@pytest.mark.parametrize(("fp16", "item"), [(False, pa.float32()), (True, pa.float16())])
def test_fields_hold_the_vectors_in_parquet(
    engines: EngineFactory, tmp_path: Path, fp16: bool, item: pa.DataType
) -> None:
    pipe = predictor(engines, embedder(tmp_path / "e.onnx"), fp16=fp16)
    columns = fields(spec(fp16=fp16))
    assert columns[0] == pa.field("embedding", pa.list_(item))
    answers = pipe.infer(batch(pipe, IMAGES[:3]))
    # As a chunk writes its shard: the answers' columns in the shard's types, and a failed
    # item's row (null): it must read back.
    arrays = [
        pa.concat_arrays([answers.columns[f.name].cast(f.type), pa.nulls(1, f.type)])
        for f in columns
    ]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(columns)), sink)
    table = pq.read_table(io.BytesIO(sink.getvalue()))
    assert table.schema.field("embedding").type == pa.list_(item)
    assert table.column("embedding").to_pylist()[-1] is None
    assert table.column("dim").to_pylist() == [DIM, DIM, DIM, None]
    stored = np.array(table.column("embedding").to_pylist()[:-1])
    np.testing.assert_allclose(stored, np.stack(embed(pipe, IMAGES[:3])), atol=1e-6)
