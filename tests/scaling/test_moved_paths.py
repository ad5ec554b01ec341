"""FP8/MX/NVFP4 emulation moved from floatguard.scaling to floatguard.emulation: the
old import paths still give the same objects, with a DeprecationWarning naming the
new path; loss scaling stays where it was, without one."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import floatguard.emulation as emulation


@pytest.mark.parametrize("name", ["EmulationRecipe", "emulate", "MX", "coverage", "Block"])
def test_a_moved_name_still_imports_from_scaling_with_a_warning(name: str) -> None:
    import floatguard.scaling as scaling

    with pytest.warns(DeprecationWarning, match=f"floatguard.emulation.{name}"):
        old = getattr(scaling, name)
    assert old is getattr(emulation, name)


@pytest.mark.parametrize(
    "module", ["recipes", "fake_quant", "coverage", "hadamard", "emulation_recipe"]
)
def test_a_moved_module_still_imports_with_a_warning(module: str) -> None:
    sys.modules.pop(f"floatguard.scaling.{module}", None)
    with pytest.warns(DeprecationWarning, match=f"floatguard.emulation.{module}"):
        old = importlib.import_module(f"floatguard.scaling.{module}")
    new = importlib.import_module(f"floatguard.emulation.{module}")
    public = getattr(new, "__all__", [])
    assert public and all(getattr(old, n) is getattr(new, n) for n in public)


def test_loss_scaling_stays_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from floatguard.scaling import DynamicLossScaler, MasterWeights

    assert DynamicLossScaler.__module__ == "floatguard.scaling.loss_scale"
    assert MasterWeights.__module__ == "floatguard.scaling.master"
