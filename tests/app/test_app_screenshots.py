"""`kvscope screenshots` drives the real app through its scenes; here on FakeRunner engines."""

from __future__ import annotations

from app_harness import FakeEngines

from kvscope.app.screenshots import SCENES, take_screenshots
from kvscope.engine.config import EngineConfig


def test_every_scene_writes_an_svg(tmp_path):
    engines = FakeEngines(num_host_blocks=64)
    config = EngineConfig(num_blocks=256, max_model_len=512, max_num_batched_tokens=256)
    paths = take_screenshots(config, tmp_path, size=(120, 36), engine_factory=engines)
    assert [p.name for p in paths] == [f"{name}.svg" for name in SCENES]
    for path in paths:
        assert path.read_text().startswith("<svg")
    overload, contiguous = engines.built[2], engines.built[3]
    assert overload.stats[-1].num_preemptions >= 3
    assert contiguous.config.allocator == "contiguous"
