"""The timing cache: a start on the same machine and model shapes takes the forward timings (and so
the linear layouts) an earlier start measured, measures only what is missing, and keeps nothing
when it is off."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_model import tiny_model

from drafter_sdk.gguf_conversion import CACHE_ENV
from verifier_service import builder
from verifier_service.api.cli import parser, settings_from_args
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
    assert second.forwards == layouts * (1 + 1 + 3)  # each: the context's prefill, a warm-up, 3 timed runs
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
    short.measure(POINTS)  # KV slots too short for the whole probe context: not comparable, not kept
    assert short.forwards > 0 and len(timing_files(cache_dir)) == 2
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
