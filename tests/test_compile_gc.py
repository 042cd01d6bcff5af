"""compile_for_rank runs with the cyclic garbage collector paused, and gives it back as it was."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from pass_fixtures import two_linear_case

import autopar.compiler.driver as driver
import autopar.compiler.lowering as lowering
from autopar.core.errors import InternalError
from autopar.core.mesh import Mesh


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_during_a_compile_and_restored_after(
    enabled_before: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    plain_emit = driver.emit

    def emit(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return plain_emit(*args, **kwargs)

    monkeypatch.setattr(driver, "emit", emit)
    model, inputs = two_linear_case()
    was = gc.isenabled()
    if not enabled_before:
        gc.disable()
    try:
        compiled = driver.compile_for_rank(model, Mesh.from_shape((2, 2)), inputs, coords=(0, 1))
        assert gc.isenabled() == enabled_before
    finally:
        if was:
            gc.enable()
    assert seen == [False]
    assert compiled.program.coords == (0, 1) and len(compiled.program.param_names) == 2


def test_an_error_inside_the_compile_still_restores_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(lowering, "insert_comm", failing)  # (the driver lowers through it)
    model, inputs = two_linear_case()
    assert gc.isenabled()
    # a failure inside a stage reaches the user as an InternalError caused by it
    with pytest.raises(InternalError, match="RuntimeError: boom") as err:
        driver.compile_for_rank(model, Mesh.from_shape((2,)), inputs, coords=(0,))
    assert isinstance(err.value.__cause__, RuntimeError)
    assert gc.isenabled()
