"""torchtitan's way in: `--override.imports moepass.torchtitan.moepass` installs moepass's Inductor route.

torchtitan 0.3.0 compiles each transformer block (and the loss) with `--compile.backend`, and for a model
with FlexAttention (every DeepSeek-V3 config it ships) it accepts only "inductor" or "aot_eager". With this
override the backend stays "inductor" and moepass runs inside it (moepass/inductor_route.py):

    python -m torchtitan.train --module deepseek_v3 --config deepseek_v3_16b \\
        --compile.enable --compile.components model,loss \\
        --override.imports 'moepass.torchtitan.moepass={"report_dir": "outputs/moepass"}'

torchtitan imports the module of each `--override.imports` target at startup, on every rank, and calls the
factory with the entry's JSON object as keyword arguments: here they are moepass's options (none: the
MOEPASS_OPTIONS environment variable, else the defaults). The factory changes no config. An override must
claim a config node; this one claims `metrics`, present in every Trainer.Config, and returns it as it was:
a model node would collide with model overrides (fused_swiglu claims nodes under the model).
"""

from __future__ import annotations

import logging

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config.override import override

from .inductor_route import install

log = logging.getLogger(__name__)


@override(target=MetricsProcessor.Config,
          description="moepass: MoE graph rewrites inside --compile.backend inductor (the config is unchanged)")
def moepass(cfg: MetricsProcessor.Config, **options) -> MetricsProcessor.Config:
    """Install moepass's Inductor route with `options`; the metrics config comes back unchanged."""
    install(options or None)
    log.info("moepass: rewrites the graphs torch.compile hands Inductor: needs --compile.enable, 'model' in "
             "--compile.components and --compile.backend inductor (the default)")
    return cfg
