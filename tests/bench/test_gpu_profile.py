"""bench.gpu's profile part: py-spy's collapsed stacks summarised per process role, thread
group and function (the part itself runs under py-spy in test_gpu_case.py)."""

from __future__ import annotations

from bench.gpu_profile import command, parse, role, summarise

ENGINE = 'process 10:"python -m kiln.app.cli run /imgs --model resnet50"'
PREP = 'process {}:"python -c from multiprocessing.spawn import spawn_main; spawn_main(fd=5)"'
RAW = [
    f"{ENGINE};{PREP.format(20)};thread (20): MainThread;main (spawn.py:1) 1",
    f"{ENGINE};thread (11): kiln-task-3;run (run.py:40);take (lease.py:12) 30",
    f"{ENGINE};thread (12): kiln-task-7;run (run.py:40);write_chunk (write.py:9) 20",
    f"{ENGINE};thread (13): resnet50-device-decode-0;_loop (stages.py:5);decode (ds.py:88) 50",
    f"{ENGINE};thread (10): MainThread;main (cli.py:3) 5",
    # a child's stack names its parent first (py-spy --subprocesses)
    f"{ENGINE};{PREP.format(20)};thread (20): MainThread;prepare (images.py:70) 40",
    f"{ENGINE};{PREP.format(21)};thread (21): MainThread;prepare (images.py:70) 60",
    "not a stack line",
]


def test_stacks_are_summarised_per_process_thread_group_and_function() -> None:
    found = parse(RAW)
    assert {role(p) for p in found.values()} == {"engine", "prep"}
    engine = found["10"]
    assert engine.samples == 105
    assert engine.threads == {"kiln-task": 50, "resnet50-device-decode": 50, "MainThread": 5}
    assert engine.own["decode (ds.py)"] == 50
    assert engine.within["run (run.py)"] == 50
    text = summarise(found, rate=100)
    assert "engine: 1 process(es), 1.1 s holding the GIL" in text
    assert "prep: 2 process(es), 1.0 s holding the GIL" in text  # 41 + 60 samples
    assert "  kiln-task: 0.50" in text and "  decode (ds.py): 0.50" in text


def test_the_process_py_spy_started_is_the_engine_even_unnamed() -> None:
    """py-spy may sample the process it started before reading its command line (CI saw
    `process 3806:""`): the root of the tree, which no parent precedes, is `kiln run`'s."""
    unnamed = [line.replace(ENGINE, 'process 10:""') for line in RAW]
    found = parse(unnamed)
    assert (role(found["10"]), role(found["20"])) == ("engine", "prep")
    assert found["10"].root and not found["20"].root
    other = parse(['process 10:"";process 30:"/usr/bin/convert";thread (30): main;x (a.py:1) 3'])
    assert role(other["30"]) == "other"  # a child that is neither prep nor named kiln


def test_a_prep_process_sampled_before_its_exec_is_still_prep() -> None:
    """Spawned prep processes are forked, then exec'd: sampled in between, a child still shows
    `kiln run`'s command line (CI counted two engines). Its newest command line says what it is."""
    forked = f"{ENGINE};{ENGINE.replace('10', '22')};thread (22): MainThread;fork (a.py:1) 1"
    later = f"{ENGINE};{PREP.format(22)};thread (22): MainThread;prepare (images.py:70) 9"
    found = parse([*RAW, forked, later])
    assert role(found["22"]) == "prep"
    assert "engine: 1 process(es)" in summarise(found, rate=100)


def test_the_command_samples_the_gil_of_the_whole_tree(tmp_path) -> None:  # type: ignore[no-untyped-def]
    prefix = command(tmp_path / "raw.txt")
    assert prefix[1:3] == ["record", "--gil"] and "--subprocesses" in prefix
    assert prefix[-1] == "--" and str(tmp_path / "raw.txt") in prefix
