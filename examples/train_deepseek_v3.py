"""Train the DeepSeek-V3 reference model with moepass: the one-line change is the compile call.

    python examples/train_deepseek_v3.py                       # debug flavor, CPU or the first GPU
    python examples/train_deepseek_v3.py --layers 4 --steps 100 --options '{"mxfp8.wgrad_bf16": true}'
"""

import argparse
import json

import torch

import moepass
from moepass.harness.corpus import Batches, load_corpus
from moepass.harness.train import train
from moepass.models import build_model

p = argparse.ArgumentParser()
p.add_argument("--flavor", default="debug")
p.add_argument("--layers", type=int, default=None)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=128)
p.add_argument("--options", default="{}", help="moepass backend options, JSON")
args = p.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
overrides = {"n_layers": args.layers} if args.layers else {}
model = build_model(args.flavor, **overrides).to(device)
compiled = torch.compile(model, backend="moepass", options=json.loads(args.options))

batches = Batches(load_corpus()[0], args.batch, args.seq)
results = train(model, compiled, batches, args.steps, device, lr=1e-3,
                on_step=lambda r: print(f"step {r.step:4d}  loss {r.loss:.4f}  {r.seconds * 1e3:8.1f} ms", flush=True))
print(moepass.last_report().summary())
