"""specserve.native: the C++ ops build on this machine, and where they cannot be built each op is its Python
reference, still row-invariant."""
import os
import subprocess
import sys
from pathlib import Path

import torch

from specserve import native


def test_the_kernels_are_built_on_this_machine():
    assert native.register(), "the native kernels did not build here (see the log): gcc, ninja, AVX2?"


def test_where_the_kernels_cannot_be_built_the_references_serve_the_ops():
    """A fresh process on a 'CPU without AVX2'."""
    script = """
import torch
from specserve import native
from specserve.native import ops
from specserve.quantization import Int8Linear
from tests.test_rows import case
native.has_avx2 = lambda: False
assert not native.register()
q, k_pool, v_pool, seq_slots = case(3, seed=2)
row_seq, row_len = torch.tensor([0, 1, 0]), torch.tensor([5, 600, 6])
out = torch.ops.specserve.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.1)
assert torch.equal(out, ops.paged_attention_rows(q, k_pool, v_pool, row_seq, row_len, seq_slots, 0.1))
alone = torch.ops.specserve.paged_attention_rows(q[1:2], k_pool, v_pool, row_seq[1:2], row_len[1:2], seq_slots, 0.1)
assert torch.equal(alone[0], out[1])
lin = Int8Linear.of(torch.randn(24, 40), torch.randn(24))
x = torch.randn(5, 40)
batch = lin(x)
assert torch.equal(batch, ops.int8_linear(x, None, 0.0, False, lin.weight, lin.scale, lin.bias))
assert all(torch.equal(lin(x[i:i + 1])[0], batch[i]) for i in range(5))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "attention and int8 linears run the slow references" in done.stderr


def test_specserve_native_0_registers_the_references_without_building():
    script = """
import torch
from specserve import native
import torch.utils.cpp_extension as cpp_extension
cpp_extension.load = lambda *args, **kwargs: exec("raise AssertionError('it built the kernels')")
assert not native.register()
x = torch.randn(3, 8)
assert torch.equal(torch.ops.specserve.argmax_rows(x), x.argmax(-1))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "SPECSERVE_NATIVE": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "could not build" not in done.stderr, "it tried to build"


def test_a_change_to_a_header_alone_changes_the_build_flags(tmp_path, monkeypatch):
    """torch rebuilds an extension when its sources or flags change and hashes no header: the headers' digest
    rides in the flags, so an edit of simd.h alone rebuilds the kernels."""
    header = tmp_path / "simd.h"
    header.write_text("inline int a() { return 1; }\n")
    monkeypatch.setattr(native, "HEADERS", [header])
    before = native.header_flag()
    assert before == native.header_flag() and before.startswith("-DSPECSERVE_HEADERS=")
    header.write_text("inline int a() { return 2; }\n")
    assert native.header_flag() != before


def test_the_references_serve_cuda_and_meta_tensors():
    """A GPU runs the drafter trainer's target pass through the references (train/features.py); the shape-only ones
    serve meta tensors, the tests' stand-in for a GPU."""
    native.register()
    for name in native.references():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specserve::{name}", "CUDA"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specserve::{name}", "Meta") == (
            name in native.SHAPE_ONLY), name
