"""Which model a run trains: a models/ flavor with overrides, or a user factory."""

from __future__ import annotations

import dataclasses
import importlib

import torch


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A models/ flavor with overrides, or a user factory `module:function` called with the overrides."""

    flavor: str = "debug"
    overrides: dict = dataclasses.field(default_factory=dict)
    factory: str | None = None

    def describe(self) -> dict:
        return {"factory" if self.factory else "flavor": self.factory or self.flavor, "overrides": self.overrides}

    def build(self, seed: int, device: torch.device, ep_group=None) -> torch.nn.Module:
        """The same initial weights for the same seed: every variant calls this afresh."""
        torch.manual_seed(seed)
        kwargs = dict(self.overrides)
        if ep_group is not None:
            kwargs["ep_group"] = ep_group
        with device:  # allocate on the device directly: large flavors need not fit in host memory twice
            if self.factory:
                module_name, _, fn_name = self.factory.partition(":")
                if not fn_name:
                    raise ValueError(f"moepass: --model {self.factory!r} must be 'module:factory'")
                model = getattr(importlib.import_module(module_name), fn_name)(**kwargs)
            else:
                from moepass.models import build_model

                model = build_model(self.flavor, **kwargs)
        return model.to(device)
