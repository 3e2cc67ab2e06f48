"""Command-line flags shared by every command that builds (and trains) a model, and the ModelSpec they name."""

from __future__ import annotations

import argparse
import json

import torch

from .model_spec import ModelSpec


def add_model_flags(p: argparse.ArgumentParser, *, batch: int, seq: int) -> None:
    """Which model, on which device, and the batch shape: shared by every command that builds a model."""
    p.add_argument("--flavor", default="debug", help="models/ flavor: debug, 16B, 236B, 671B (default: debug)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--model-overrides", default=None, help='JSON dict of config overrides, e.g. \'{"dim": 512}\'')
    p.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help="a user model instead of a flavor: FACTORY(**overrides[, ep_group=...]) -> "
                        "module mapping tokens [B, S] to logits [B, S, V>=256]")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=batch, help="sequences per step (per rank)")
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches")


def add_model_arguments(p: argparse.ArgumentParser, *, steps: int, batch: int, seq: int) -> None:
    """Model, data and training flags shared by bench and converge."""
    add_model_flags(p, batch=batch, seq=seq)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", default=None, help="text file or directory (default: the Python stdlib's source)")
    p.add_argument("--options", default=None, help='backend options for moepass variants, as JSON')
    p.add_argument("--log-every", type=int, default=None, help="progress line every k steps")


def model_spec(args) -> ModelSpec:
    overrides = json.loads(args.model_overrides) if args.model_overrides else {}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    return ModelSpec(args.flavor, overrides, args.model)
