"""See what moepass rewrites in a model, without training: a table, plus an HTML page to browse.

    python examples/inspect_model.py out/        # then open out/report.html
"""

import sys

import torch

import moepass
from moepass.models import build_model

out_dir = sys.argv[1] if len(sys.argv) > 1 else "moepass-report"
torch.manual_seed(0)
model = build_model("debug")
tokens = torch.randint(0, model.config.vocab_size, (2, 64))
report = moepass.inspect(model, tokens, options={"lowp.exclude": ["layers.0.*"]})  # e.g. keep the dense layer BF16
print(report.summary())
print("HTML report:", report.save(out_dir))
