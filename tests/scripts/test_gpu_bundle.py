"""The offline GPU bundle (scripts/gpu-bundle.sh, scripts/gpu_bundle.py, scripts/gpu-unpack.sh),
without building one (that downloads hundreds of MB): the part lists against pyproject and
against what Kiln imports, and the unpack script run for real on a tiny bundle made here."""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import tarfile
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bundle  # noqa: E402

UNPACK = ROOT / "scripts" / "gpu-unpack.sh"
# What a GPU run imports: Kiln itself, the bench, the stacks they start, the GPU tests.
GPU_RUN_CODE = ("app", "workers", "kiln", "bench", "devstack", "tests/gpu")


def test_every_core_dependency_is_in_core_or_moved_to_a_part() -> None:
    parts = gpu_bundle.parts()
    core = {gpu_bundle.requirement_name(r) for r in parts["core"].deps}
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]:
        name = gpu_bundle.requirement_name(requirement)
        assert name in core or name in gpu_bundle.MOVED, name
    for name, part in gpu_bundle.MOVED.items():
        assert name in {gpu_bundle.requirement_name(r) for r in parts[part].deps}
    # the OCR part's requirements are pyproject's own lines (gpu extra), not copies
    assert {gpu_bundle.requirement_name(r) for r in parts["ocr"].deps} == {"pyclipper", "shapely"}


def test_no_part_names_what_the_image_has_and_nothing_is_both_present_and_dropped() -> None:
    assert not set(gpu_bundle.DROPPED) & gpu_bundle.PRESENT
    for name, part in gpu_bundle.parts().items():
        if name == "core":  # pyproject's list: numpy, onnx... are left out when selected
            continue
        named = {gpu_bundle.requirement_name(r) for r in (*part.deps, *part.nodeps)}
        assert not named & gpu_bundle.PRESENT, name


def test_selection_leaves_out_the_image_the_dropped_and_what_core_carries(tmp_path: Path) -> None:
    def wheels(*names: str) -> list[Path]:
        return [tmp_path / f"{n}-1.0-py3-none-any.whl" for n in names]

    core = wheels("celery", "numpy", "Pillow", "flower", "nvidia_cublas", "SQLAlchemy")
    assert [w.name.split("-")[0] for w in gpu_bundle.carried("core", core)] == [
        "celery",
        "SQLAlchemy",
    ]
    video = wheels("av", "celery", "numpy", "boto3")
    assert [w.name.split("-")[0] for w in gpu_bundle.carried("video", video, core)] == [
        "av",
        "boto3",
    ]
    decoder = wheels("nvidia_nvimgcodec_cu13", "nvidia_nvjpeg")  # CUDA libraries of its own
    assert gpu_bundle.carried("decoder", decoder, core) == decoder


def test_a_part_without_python_packages_asks_pip_for_nothing(tmp_path: Path) -> None:
    helper = [sys.executable, str(ROOT / "scripts" / "gpu_bundle.py")]
    for command in (["requirements", "services", "deps"], ["select", "services", str(tmp_path)]):
        out = subprocess.run([*helper, *command], capture_output=True, text=True, check=True)
        assert out.stdout == "", command  # not one empty line: the shell would read an item


def _imported_modules(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def test_no_code_a_gpu_run_imports_needs_a_dropped_package() -> None:
    """A package the bundle leaves out must stay unimported: a new import of one fails here
    rather than on a lent GPU host."""
    by_module = metadata.packages_distributions()
    imported = set().union(*(_imported_modules(ROOT / f) for f in GPU_RUN_CODE))
    needs = {
        gpu_bundle.canonical(dist): module
        for module in imported
        for dist in by_module.get(module, [])
    }
    assert not set(needs) & set(gpu_bundle.DROPPED), {
        d: needs[d] for d in set(needs) & set(gpu_bundle.DROPPED)
    }


def test_no_file_refers_to_the_shared_folder_beside_the_repository() -> None:
    """The bundle belongs to the project: no file points at the folder beside the checkout that
    once held it (test_docs.py's own strings test that such a link is caught)."""
    needle = "/".join(["..", "shared"])  # spelled so, this file does not match itself
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    offending = [
        f
        for f in files
        if f != "tests/test_docs.py"
        and (ROOT / f).is_file()
        and needle in (ROOT / f).read_text(errors="replace")
    ]
    assert offending == []


# --- the unpack script on a tiny bundle ------------------------------------------------------


def _pack(bundle: Path, part: str, files: dict[str, str]) -> None:
    with tarfile.open(bundle / f"{part}.tar.xz", "w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{part}/{name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


def _bundle(tmp_path: Path, python: str = "", present: str = "pytest") -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(parents=True)
    version = python or "{}.{}".format(*sys.version_info[:2])
    _pack(bundle, "core", {
        "python.txt": version + "\n",
        "present.txt": present + "\n",
        "commit.txt": "0" * 40 + "\n",
        "site/fakedep.py": "VALUE = 'from core/site'\n",
        "kiln/kiln/__init__.py": "",
        "kiln/kiln/app/__init__.py": "",
        "kiln/kiln/app/cli.py": "import sys, fakedep, fakevideo\n"
        "print('fake kiln', fakedep.VALUE, fakevideo.VALUE, *sys.argv[1:])\n",
    })  # fmt: skip
    _pack(bundle, "video", {"site/fakevideo.py": "VALUE = 'from video/site'\n"})
    return bundle


def _unpack(bundle: Path, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KILN_GPU_DIR": str(work), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(UNPACK), *args, str(bundle)], env=env, capture_output=True, text=True
    )


def test_unpack_prints_exports_that_run_kiln_from_every_part(tmp_path: Path) -> None:
    bundle, work = _bundle(tmp_path), tmp_path / "work"
    first = _unpack(bundle, work)
    assert first.returncode == 0, first.stderr
    assert "unpacking core" in first.stderr and "unpacking video" in first.stderr
    assert "WARNING" not in first.stderr and "services" not in first.stderr
    # the exports, evaluated by a shell as `eval "$(gpu-unpack.sh)"` does
    shell = f'{first.stdout}\nkiln --fast; echo "$PWD"; python -c "import fakevideo"'
    ran = subprocess.run(
        ["bash", "-c", shell], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert ran.stdout.splitlines() == [
        "fake kiln from core/site from video/site --fast",
        str(work / "core" / "kiln"),
    ]
    assert (work / "core" / "site" / "__pycache__").is_dir()  # compiled on arrival
    # bin/kiln works without the exports too (the worker's children inherit its PYTHONPATH)
    alone = subprocess.run(
        [work / "bin" / "kiln"], cwd=ROOT, capture_output=True, text=True, check=True
    )  # from the repository's root, whose own `kiln` it must not import
    assert alone.stdout.startswith("fake kiln")
    again = _unpack(bundle, work)  # unchanged parts are kept as they are
    assert again.returncode == 0 and "unpacking" not in again.stderr
    assert again.stdout == first.stdout


def test_a_part_of_another_bundle_unpacked_before_is_not_on_the_path(tmp_path: Path) -> None:
    work = tmp_path / "work"
    assert _unpack(_bundle(tmp_path / "a"), work).returncode == 0
    smaller = _bundle(tmp_path / "b")
    (smaller / "video.tar.xz").unlink()
    run = _unpack(smaller, work)  # the same core (kept as unpacked), no video
    assert run.returncode == 0 and "unpacking" not in run.stderr
    assert str(work / "core" / "site") in run.stdout and "video" not in run.stdout


def test_unpack_refuses_another_python_and_names_what_the_image_lacks(tmp_path: Path) -> None:
    wrong = _unpack(_bundle(tmp_path / "a", python="2.7"), tmp_path / "a" / "work")
    assert wrong.returncode == 1
    assert "the bundle is for CPython 2.7" in wrong.stderr and "BUNDLE_PYTHON=" in wrong.stderr
    lacking = _unpack(_bundle(tmp_path / "b", present="pytest no-such-dist"), tmp_path / "b" / "w")
    assert lacking.returncode == 0
    assert "WARNING" in lacking.stderr and "no-such-dist" in lacking.stderr
    assert "pytest" not in lacking.stderr.split("lacks them:")[1]


def test_unpack_asks_for_the_services_part_before_starting_services(tmp_path: Path) -> None:
    run = _unpack(_bundle(tmp_path), tmp_path / "work", "--services")
    assert run.returncode == 1 and "no services.tar.xz" in run.stderr


@pytest.mark.parametrize("script", ["gpu-bundle.sh", "gpu-unpack.sh", "gpu-session.sh"])
def test_the_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
