"""A report that reads at any depth: identical layers folded into one line, the coverage first, details one click
away. Under `-m extended`: DeepSeek-V3's 61 layers (3 dense, tiny dims) give a page under 200 KB whose first screen is
the coverage, and headless Chromium renders it (skipped without a browser)."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest
import torch
from helpers import TINY

import moepass
from moepass.report.collapse import fold_gemms, fold_records, layer_key, pattern, ranges
from moepass.report.coverage import BF16, LOW_PRECISION, GemmUse
from moepass.models import build_model
from moepass.report.records import Skip

PAGE_LIMIT = 200_000  # bytes
SCREEN = (1280, 800)  # the first screen: a laptop browser window


def test_module_paths_fold_on_their_numbers():
    assert layer_key("layers.12.moe.experts.7") == ("layers.{}.moe.experts.{}", (12, 7))
    assert layer_key("output") == ("output", ())
    assert ranges([5, 1, 2, 3, 7, 8]) == "1-3,5,7-8"
    assert pattern("layers.{}.moe.experts.{}", [(1, 0), (1, 1), (2, 0), (2, 1)]) == "layers.1-2.moe.experts.0-1"


def _layer(i: int, moe: bool) -> list[GemmUse]:
    uses = [GemmUse(f"linear_{i}_{w}", f"layers.{i}.attn.{w}", "weight", "moepass.fp8_rowwise_linear", LOW_PRECISION)
            for w in ("wq", "wkv_a", "wkv_b", "wo")]
    if moe:
        uses.append(GemmUse(f"gate_{i}", f"layers.{i}.moe.router.gate", "weight", "linear", BF16, "ROUTER_GATE"))
        uses += [GemmUse(f"gmm_{i}_{w}", f"layers.{i}.moe.experts", w, "moepass.fp8_rowwise_grouped_mm", LOW_PRECISION)
                 for w in ("w1", "w3", "w2")]
    return uses


def test_identical_layers_fold_into_one_line_each():
    uses = [u for i in range(61) for u in _layer(i, moe=i >= 1)]
    lines = [f.line() for f in fold_gemms(uses)]
    assert lines == ["layers.0-60.attn: wq, wkv_a, wkv_b, wo → fp8_rowwise linear (×61)",
                     "layers.1-60.moe.router: gate → BF16: ROUTER_GATE (×60)",
                     "layers.1-60.moe.experts: w1, w3, w2 → fp8_rowwise grouped GEMM (×60)"]
    # a layer that differs keeps a line of its own
    uses[-1] = GemmUse("gmm_60_w2", "layers.60.moe.experts", "w2", "linear", BF16, "NOT_A_MULTIPLE")
    lines = [f.line() for f in fold_gemms(uses)]
    assert "layers.1-59.moe.experts: w1, w3, w2 → fp8_rowwise grouped GEMM (×59)" in lines
    assert "layers.60.moe.experts: w1, w3 → fp8_rowwise grouped GEMM" in lines
    assert "layers.60.moe.experts: w2 → BF16: NOT_A_MULTIPLE" in lines


def test_skips_fold_with_their_module_paths_in_the_reason():
    skips = [("linear", Skip(f"gate_{i}", f"layers.{i}.moe.router.gate",
                             f"module path 'layers.{i}.moe.router.gate' matches no lowp.include pattern"))
             for i in range(3, 61)]
    ((name, folded),) = fold_records(skips, lambda s: s.reason)
    assert (name, folded.modules, folded.nodes, folded.count) == ("linear", "layers.3-60.moe.router.gate", 58, 58)
    assert folded.outcome == "module path 'layers.3-60.moe.router.gate' matches no lowp.include pattern"


@pytest.fixture(scope="module")
def deepseek_61_layers(tmp_path_factory):
    """DeepSeek-V3's depth (61 layers, the first 3 dense) at the tests' tiny widths, inspected once and saved."""
    out = tmp_path_factory.mktemp("report61")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("debug", **{**TINY, "n_layers": 61, "n_dense_layers": 3})
    report = moepass.inspect(model, torch.randint(0, TINY["vocab_size"], (1, 16)), options={"inductor": False})
    return report, pathlib.Path(report.save(str(out)))


@pytest.mark.extended  # building and inspecting 61 layers takes a minute on CI's 2 cores; the folding is tested above
def test_the_61_layer_page_is_small_and_opens_on_the_coverage(deepseek_61_layers):
    report, page = deepseek_61_layers
    text = page.read_text()
    assert len(text.encode()) < PAGE_LIMIT, f"{len(text.encode())} bytes"
    cov = report.coverage()
    assert (cov["gemms"], cov["unaccounted"], cov["bf16"]) == (660, 0, {"OUTPUT_HEAD": 1, "ROUTER_GATE": 58})
    # first the title, the one-line intro and the coverage; everything else after it
    body = text[text.index("<body>"):]
    assert body.index("class='coverage'") < body.index("<h2") < body.index("<details")
    assert f"{cov['low_precision_flop_share'] * 100:.1f}%" in body[:body.index("<h2")]
    folded = [f.line() for f in report.folded_gemms()]
    assert "layers.3-60.moe.experts: w1, w3, w2 → mxfp8 grouped GEMM (×58)" in folded
    assert "layers.0-60.attention: wq, wkv_a, wkv_b, wo → mxfp8 linear (×61)" in folded
    assert len(folded) <= 8 and all(line in text for line in
                                    ["layers.3-60.moe.experts", "layers.0-60.attention", "&times;58"])
    # the same numbers in the summary and index.json; each graph's every GEMM on its own page, one click away
    index = json.loads((page.parent / "index.json").read_text())
    assert index["coverage"] == cov and len(index["gemms_folded"]) == len(folded)
    assert report.summary().count("\n  layers.") <= 20 and "(×58)" in report.summary()
    graph_page = (page.parent / "graphs/0/report.html").read_text()
    assert graph_page.count("<tr class='low_precision'>") >= cov["low_precision"]


def _browser() -> str | None:
    return next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)


@pytest.mark.extended
def test_the_61_layer_page_renders_its_coverage_on_the_first_screen(request, tmp_path):
    """Headless Chromium draws the page at a laptop window's size: the coverage box (its green) and its big
    share figure (dark green) are on that first screen."""
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium)")
    image = pytest.importorskip("PIL.Image")
    _, page = request.getfixturevalue("deepseek_61_layers")  # built only where there is a browser
    shot = tmp_path / "first_screen.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={SCREEN[0]},{SCREEN[1]}", f"--screenshot={shot}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = image.open(shot).convert("RGB")
    assert pixels.size == SCREEN
    colors = pixels.getcolors(SCREEN[0] * SCREEN[1])
    count = {rgb: n for n, rgb in colors}
    box, figure = _css_color("coverage"), _css_color("share")
    assert count.get(box, 0) > 0.1 * SCREEN[0] * SCREEN[1]  # the coverage box fills a good part of the screen
    assert count.get(figure, 0) > 500  # the share, in large dark-green digits


def _css_color(rule: str) -> tuple[int, int, int]:
    """The coverage box's background, or the share figure's color, as the page's CSS declares them."""
    from moepass.report.files import _CSS

    found = re.search(r"\.coverage\{background:#(\w{6})" if rule == "coverage" else
                      r"\.share\{[^}]*color:#(\w{6})", _CSS)
    return tuple(int(found.group(1)[i:i + 2], 16) for i in (0, 2, 4))
