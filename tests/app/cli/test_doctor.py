"""`kiln doctor` on this host, for real: no GPU, ONNX Runtime on the CPU is what is left."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kiln.app.cli.commands import app


def test_doctor_json_on_a_cpu_host() -> None:
    done = CliRunner().invoke(app, ["doctor", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["chosen"] == "onnxruntime-cpu"
    backends = {b["backend"]: b for b in report["backends"]}
    assert list(backends) == ["tensorrt", "onnxruntime-cuda", "torch-cuda", "onnxruntime-cpu"]
    assert [b["usable"] for b in backends.values()] == [False, False, False, True]
    pieces = {c["piece"]: c for c in report["checks"]}
    assert not pieces["GPUs"]["ok"]
    assert pieces["ONNX Runtime"]["ok"]
    assert report["conflict"] is None  # the dev install is the `cpu` flavour alone


def test_doctor_table() -> None:
    done = CliRunner().invoke(app, ["doctor"])
    assert done.exit_code == 0, done.output
    assert "Engine backends, best first" in done.output
    assert "KILN_ENGINE=auto would build with onnxruntime-cpu first." in done.output
