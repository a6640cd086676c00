"""Memory that must stay flat in long runs (issue 12, item 7).

The engine core's RSS crept up for thousands of requests: oneDNN compiles and caches (two LRU caches, 1024
entries each) a primitive per input shape of every packed linear layer, ~0.5 MB each, and every prefill
size was a new shape. Linear now rounds the row count up to a bounded set of sizes."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.linear import Linear, LoadContext, onednn_linear_available, padded_rows

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="needs a PyTorch build with oneDNN")

_RSS_PROBE = """
import os, torch
from tokenmill.layers.linear import Linear, LoadContext

def rss_mib():
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

torch.set_num_threads(2)
lin = Linear(256, 768)
lin.weight.data.normal_()
lin.process_after_loading(LoadContext("cpu", torch.float32, "onednn"))
x = torch.randn(1024, 256)
with torch.inference_mode():
    lin(x[:40])
    before = rss_mib()
    for m in range(33, 1025):  # every prefill size from 33 to 1024 tokens
        lin(x[:m])
print(rss_mib() - before)
"""


def test_padded_rows_are_few_and_waste_little():
    sizes = {padded_rows(m) for m in range(1, 2049)}
    assert len(sizes) <= 80
    for m in range(1, 5000):
        p = padded_rows(m)
        assert m <= p <= m * 1.125 + 1 and padded_rows(p) == p
    assert [padded_rows(m) for m in range(1, 33)] == list(range(1, 33))  # decode batches stay exact


@needs_onednn
@pytest.mark.parametrize("m", [1, 7, 33, 100, 257, 1000])
def test_padded_linear_matches_the_plain_one(m):
    g = torch.Generator().manual_seed(m)
    lin = Linear(64, 96, bias=True)
    lin.weight.data.normal_(generator=g)
    lin.bias.data.normal_(generator=g)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.process_after_loading(LoadContext("cpu", torch.float32, "onednn"))  # the oneDNN-packed path
    x = torch.randn(m, 64, generator=g)
    y = lin(x)
    assert y.shape == (m, 96) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_onednn_linear_memory_stays_bounded_across_row_counts():
    """992 distinct row counts through one packed linear layer: ~600 MiB before the fix, tens after."""
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, timeout=300, check=True)
    growth_mib = float(out.stdout.strip().splitlines()[-1])
    assert growth_mib < 150, f"RSS grew {growth_mib:.0f} MiB"
