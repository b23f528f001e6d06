"""The timing cache: a start on the same machine and model shapes takes the forward timings (and so
the linear layouts) an earlier start measured, measures only what is missing, and keeps nothing
when it is off."""

from __future__ import annotations

import fcntl
import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tiny_model import tiny_model

from drafter_sdk.loading.gguf_conversion import CACHE_ENV
from verifier_service import builder
from verifier_service.api.cli import parser, settings_from_args
from verifier_service.model import step_costs, timing_cache
from verifier_service.model.kv_cache import KVCache, KVCacheShape
from verifier_service.model.runner import ModelRunner
from verifier_service.settings import ServerSettings

POINTS = [1, 2, 3, 16]
ON, OFF, REFRESH = ServerSettings(), ServerSettings(timing_cache="off"), ServerSettings(timing_cache="refresh")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


class Counted:
    """A runner whose forwards are counted."""

    def __init__(self, seed: int = 0, capacity: int = 512, **shape: int) -> None:
        model = tiny_model(seed=seed, **shape)
        self.runner = ModelRunner(model, KVCache(KVCacheShape.for_model(model.config, num_slots=1, capacity=capacity),
                                                 model.dtype, model.device))
        self.forwards = 0
        forward = self.runner.forward

        def counted(batch):  # noqa: ANN001, ANN202
            self.forwards += 1
            return forward(batch)

        self.runner.forward = counted  # type: ignore[method-assign]

    def measure(self, points: list[int], settings: ServerSettings = ON) -> dict[int, float]:
        return builder._measure(self.runner, points, settings)


@pytest.fixture
def runners() -> Iterator[list[Counted]]:
    made: list[Counted] = []
    yield made
    for counted in made:
        counted.runner.close()


def timing_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "timing").glob("*.json")) if (cache_dir / "timing").exists() else []


def test_a_second_start_takes_every_timing_and_layout_from_the_cache(runners, cache_dir, caplog) -> None:  # noqa: ANN001
    first, second = Counted(seed=0), Counted(seed=1)  # other weights, same shapes
    runners += [first, second]
    seconds = first.measure(POINTS)
    assert first.forwards > 0 and len(timing_files(cache_dir)) == 1
    with caplog.at_level(logging.INFO, logger="verifier_service.builder"):
        assert second.measure(POINTS) == seconds
    assert second.forwards == 0
    assert second.runner.layouts.table() == first.runner.layouts.table()
    assert "forward timings found, 0 measured" in caplog.text


def test_only_the_missing_counts_are_measured_and_the_file_grows(runners, cache_dir) -> None:  # noqa: ANN001
    first, second, third = Counted(), Counted(), Counted()
    runners += [first, second, third]
    first.measure(POINTS[:3])
    layouts = len(second.runner.layouts.available)
    second.measure(POINTS)  # 16 is new: measured, under every layout
    # the context's prefill once, then under each layout a warm-up and 3 timed runs
    assert second.forwards == 1 + layouts * (1 + 3)
    third.measure(POINTS)
    assert third.forwards == 0 and len(timing_files(cache_dir)) == 1


def test_other_shapes_or_cache_off_measure_afresh(runners, cache_dir, monkeypatch) -> None:  # noqa: ANN001
    base, deeper, off, short = Counted(), Counted(layers=3), Counted(), Counted(capacity=40)
    runners += [base, deeper, off, short]
    base.measure(POINTS)
    deeper.measure(POINTS)
    assert deeper.forwards > 0 and len(timing_files(cache_dir)) == 2
    off.measure(POINTS, OFF)  # --timing-cache off
    assert off.forwards > 0 and len(timing_files(cache_dir)) == 2
    # KV slots too short for the whole probe context: timed after the 24 tokens that fit beside 16, kept apart
    # (32 tokens, over half a slot, are not timed)
    seconds = short.measure([*POINTS, 32])
    assert short.forwards > 0 and len(timing_files(cache_dir)) == 3
    contexts = sorted(json.loads(path.read_text())["key"]["measure"]["context_len"] for path in timing_files(cache_dir))
    assert contexts == [24, step_costs.CONTEXT_LEN, step_costs.CONTEXT_LEN]
    short_again = Counted(capacity=40)  # a start with the same short slots takes them
    runners.append(short_again)
    assert short_again.measure([*POINTS, 32]) == seconds and short_again.forwards == 0
    monkeypatch.setenv(CACHE_ENV, "off")
    again = Counted()
    runners.append(again)
    again.measure(POINTS)
    assert again.forwards > 0


def test_an_unreadable_cache_file_is_measured_over(runners, cache_dir, caplog) -> None:  # noqa: ANN001
    first, second, third = Counted(), Counted(), Counted()
    runners += [first, second, third]
    first.measure(POINTS)
    (path,) = timing_files(cache_dir)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        second.measure(POINTS)
    assert second.forwards > 0 and "ignoring the unreadable timing cache" in caplog.text
    third.measure(POINTS)  # the file was written anew
    assert third.forwards == 0


def test_refresh_times_everything_again_and_keeps_it(runners, cache_dir) -> None:  # noqa: ANN001
    first, refreshed, third = Counted(), Counted(), Counted()
    runners += [first, refreshed, third]
    first.measure(POINTS)
    seconds = refreshed.measure(POINTS, REFRESH)
    assert refreshed.forwards > 0  # what first kept was not used ...
    assert third.measure(POINTS) == seconds and third.forwards == 0  # ... and what refreshed timed was kept


def test_the_flag() -> None:
    assert settings_from_args(parser().parse_args([])).timing_cache == "on"
    for value in ("off", "refresh"):
        assert settings_from_args(parser().parse_args(["--timing-cache", value])).timing_cache == value
    with pytest.raises(SystemExit):
        parser().parse_args(["--timing-cache", "sometimes"])


def test_a_runner_without_layouts_as_on_cuda_keeps_one_curve(runners, cache_dir) -> None:  # noqa: ANN001
    first, second = Counted(), Counted()
    runners += [first, second]
    for counted in (first, second):  # what a CUDA runner is: no linear layouts to choose
        counted.runner.layouts.uninstall()
        counted.runner.layouts = None
    seconds = first.measure(POINTS)
    assert sorted(seconds) == POINTS and first.forwards == 1 + len(POINTS) * (1 + 3)
    assert second.measure(POINTS) == seconds and second.forwards == 0


def test_disturbed_timings_are_neither_kept_nor_read(runners, cache_dir, monkeypatch, caplog) -> None:  # noqa: ANN001
    """A busy machine only adds time: a shorter forward far slower than a longer one was disturbed."""
    assert step_costs.disturbance({"a": {1: 0.030, 2: 0.031, 9: 0.050, 16: 0.058}}) is None
    assert step_costs.disturbance({"a": {1: 0.0010, 2: 0.0040, 16: 0.0011}}) is None  # a fast device's jitter
    assert step_costs.disturbance({"a": {1: 0.030, 2: 1.3, 16: 0.058}, "b": {2: 0.5}}) == \
        "2 tokens took 500.0 ms, 16 tokens 58.0 ms"  # each count under its fastest layout
    assert step_costs.disturbance({"a": {2: 0.2}, "b": {2: 0.03, 16: 0.05}}) is None

    first, second, third = Counted(), Counted(), Counted()
    runners += [first, second, third]
    measure = step_costs.measure_shapes

    def busy(runner, shapes, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seconds = measure(runner, shapes, *args, **kwargs)
        return {(layout, t): s + (1.0 if t == 2 else 0.0) for (layout, t), s in seconds.items()}

    monkeypatch.setattr(step_costs, "measure_shapes", busy)
    with caplog.at_level(logging.WARNING):
        first.measure(POINTS)
    assert "disturbed by other work on this machine (2 tokens took" in caplog.text
    assert timing_files(cache_dir) == []
    monkeypatch.setattr(step_costs, "measure_shapes", measure)
    second.measure(POINTS)  # what the busy start measured was not kept: measured again, and kept
    assert second.forwards > 0 and len(timing_files(cache_dir)) == 1

    (path,) = timing_files(cache_dir)  # a file a busy machine wrote (an earlier version kept such)
    kept = json.loads(path.read_text())
    kept["seconds"] = {layout: {**seconds, "2": 1.0} for layout, seconds in kept["seconds"].items()}
    path.write_text(json.dumps(kept))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        third.measure(POINTS)
    assert third.forwards > 0 and "measured on a busy machine" in caplog.text


def test_verifiers_starting_together_take_turns_to_measure(runners, cache_dir) -> None:  # noqa: ANN001
    """Two starts at once: one measures, the other waits for it and takes its timings; neither times
    its forwards against the other's."""
    a, b = Counted(), Counted()
    runners += [a, b]
    for counted in (a, b):  # slow forwards: without turns, both would be measuring at once
        forward = counted.runner.forward

        def slow(batch, forward=forward):  # noqa: ANN001, ANN202
            time.sleep(0.005)
            return forward(batch)

        counted.runner.forward = slow  # type: ignore[method-assign]
    start = threading.Barrier(2)

    def measure(counted: Counted) -> dict[int, float]:
        start.wait()
        return counted.measure(POINTS)

    with ThreadPoolExecutor(2) as pool:
        seconds = list(pool.map(measure, (a, b)))
    assert sorted([a.forwards == 0, b.forwards == 0]) == [False, True]
    assert seconds[0] == seconds[1]


def test_a_turn_held_too_long_is_not_waited_for_forever(runners, cache_dir, monkeypatch, caplog) -> None:  # noqa: ANN001
    counted = Counted()
    runners.append(counted)
    monkeypatch.setattr(timing_cache, "TURN_WAIT_S", 0.3)
    (cache_dir / "timing").mkdir()
    with open(cache_dir / "timing" / ".measuring.lock", "a") as held:  # another verifier, hung while measuring
        fcntl.flock(held, fcntl.LOCK_EX)
        with caplog.at_level(logging.INFO, logger="verifier_service.model.timing_cache"):
            started = time.monotonic()
            counted.measure(POINTS)
    assert time.monotonic() - started >= 0.3 and counted.forwards > 0
    assert "waiting for another verifier" in caplog.text and "timing them now" in caplog.text


def test_a_curve_on_which_no_draft_pays_is_said_so(runners, monkeypatch, caplog) -> None:  # noqa: ANN001
    """Forward costs no draft could beat (as a busy start-up measures them) leave speculation off
    without an error anywhere: the log says why."""
    counted = Counted()
    runners.append(counted)
    settings = settings_from_args(parser().parse_args(["--speculative-mode", "ngram", "--max-draft-len", "4"]))
    for seconds, warned in (({1: 0.03, 2: 0.031, 3: 0.034, 4: 0.04, 5: 0.045, 16: 0.06}, False),
                            ({1: 0.03, 2: 0.36, 3: 0.36, 4: 0.36, 5: 0.36, 16: 0.36}, True)):
        monkeypatch.setattr(builder, "_measure", lambda runner, points, settings, seconds=seconds: seconds)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="verifier_service.builder"):
            planner, _ = builder.calibrate(counted.runner, settings, 512)
        assert planner is not None
        assert ("no draft pays, even if every token were accepted (2 tokens cost 12.00x one)" in caplog.text) is warned
