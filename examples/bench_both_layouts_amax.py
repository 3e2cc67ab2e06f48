"""The FP8-rowwise both-layouts op (triton_kernels.both_layouts) against an earlier version of it, on CUDA.

For DeepSeek-V3's linear operands and expert weights it checks both versions' outputs bit for bit, the per-tile amax
against torch's, and times (CUDA events) both ops, the amax pass at six tiles and the op at four quantize tiles.
The earlier version is a copy of triton_kernels.py with absolute imports, e.g. the atomics one of 3ab3daa:

    git show 3ab3daa:moepass/ops/lowp/fp8_rowwise/triton_kernels.py \\
        | sed -e 's/^from \\.\\.formats/from moepass.ops.lowp.formats/' \\
              -e 's/^from \\.quant/from moepass.ops.lowp.fp8_rowwise.quant/' > /tmp/old_triton_kernels.py
    OUT=out python examples/bench_both_layouts_amax.py /tmp/old_triton_kernels.py
"""
import importlib.util, json, os, sys, torch, triton

if len(sys.argv) != 2 or not os.environ.get("OUT") or not torch.cuda.is_available():
    sys.exit("usage: OUT=DIR python examples/bench_both_layouts_amax.py OLD_TRITON_KERNELS.py (needs a CUDA GPU)")
_spec = importlib.util.spec_from_file_location("old_triton_kernels", sys.argv[1])
old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(old)
from moepass.ops.lowp.fp8_rowwise import triton_kernels as new
from moepass.ops.lowp.fp8_rowwise.quant import scale_from_amax

def t_ms(fn, warm=3, iters=10):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(iters): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / iters

SHAPES = [("671B wq_b grad", 1, 16384, 24576), ("671B wo input", 1, 16384, 16384), ("671B wq_a input", 1, 16384, 7168),
          ("671B wo grad", 1, 16384, 7168), ("671B wq_a grad", 1, 16384, 1536), ("671B shared w1 grad", 1, 16384, 2048),
          ("671B experts w1 [E,N,K]", 32, 2048, 7168), ("671B experts w2", 32, 7168, 2048),
          ("16B dense w1 grad", 1, 32768, 10944), ("16B wq grad", 1, 32768, 3072)]
AMAX_TILES = [(256, 32, 128), (128, 32, 128), (256, 16, 256), (512, 32, 128), (256, 64, 64), (128, 16, 256)]
QUANTIZE_TILES = [(128, 64), (64, 128), (128, 128), (64, 64)]
rows = []
tot_old = tot_new = 0.0
for name, e, r, c in SHAPES:
    t = torch.randn(e, r, c, device="cuda").to(torch.bfloat16) * torch.rand(e, r, 1, device="cuda").to(torch.bfloat16)
    o, n = old.both_layouts(t), new.both_layouts(t)
    exact = all(torch.equal(x.float(), y.float()) for x, y in zip(o, n))
    ra, ca = new.tile_amax(t)
    amax_exact = torch.equal(ra, t.abs().amax(-1).float()) and torch.equal(ca, t.abs().amax(-2).float())
    ms_old, ms_new = t_ms(lambda: old.both_layouts(t)), t_ms(lambda: new.both_layouts(t))
    tiles = {f"{tr}x{lr}x{tc}": round(t_ms(lambda: new.tile_amax(t, tr, lr, tc)), 4) for tr, lr, tc in AMAX_TILES}
    qtiles = {f"{br}x{bc}": round(t_ms(lambda: new.both_layouts(t, br, bc)), 4) for br, bc in QUANTIZE_TILES}
    gb = 6 * t.numel() / 1e9
    row = dict(operand=name, shape=[e, r, c], bit_exact=exact, amax_exact=amax_exact, old_ms=round(ms_old, 4),
               new_ms=round(ms_new, 4), new_GBps_6B=round(gb / ms_new * 1e3, 1), amax_tiles_ms=tiles,
               both_tiles_ms=qtiles)
    rows.append(row)
    if name.startswith("671B"): tot_old += ms_old; tot_new += ms_new
    print(json.dumps(row), flush=True)
print(f"671B sum old {tot_old:.3f} ms new {tot_new:.3f} ms")
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
          open(os.environ["OUT"] + "/micro_amax.json", "w"), indent=1)
