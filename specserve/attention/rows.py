"""The row-invariant float32 attention op, `torch.ops.specserve.paged_attention_rows`, which the scripted layer
stack calls for float32 and float16 KV pools. Its kernel (rows.cpp) is compiled for this machine on first use
(gcc and ninja, explicit -mavx2 -mfma -mf16c rather than -march=native) into torch's extension cache. Where it
cannot be built (no compiler, a CPU without AVX2) the op is registered with a reference implementation instead:
one SDPA call per query row over that row's own keys, row-invariant too (every call has the same shape), but
slow."""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rows.cpp")
SIGNATURE = ("paged_attention_rows(Tensor q, Tensor k_pool, Tensor v_pool, Tensor row_seq, Tensor row_len, "
             "Tensor seq_slots, float scale) -> Tensor")


@functools.cache
def register() -> bool:
    """Make the op exist (once per process); True when it runs the compiled kernel."""
    if _has_avx2():
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        try:
            load(name="specserve_attention_rows", sources=[str(SOURCE)], is_python_module=False, verbose=False,
                 extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"])
            log.info("float32 attention kernel ready in %.1f s", time.perf_counter() - start)
            return True
        except Exception as exc:      # no compiler, no ninja, a failed build
            log.warning("could not build the float32 attention kernel (%s): float32 attention runs the slow "
                        "reference; --kv-cache-dtype float64 may be faster", exc)
    else:
        log.warning("this CPU lacks AVX2, FMA or F16C: float32 attention runs the slow reference")
    library = torch.library.Library("specserve", "DEF")
    library.define(SIGNATURE)
    library.impl("paged_attention_rows", reference, "CPU")
    _libraries.append(library)        # the registration lasts as long as the Library object
    return False


_libraries: list[torch.library.Library] = []


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, row_seq: torch.Tensor,
              row_len: torch.Tensor, seq_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """What the kernel computes, one row at a time. q: [rows, heads, head_dim] → [rows, heads, head_dim]."""
    out = torch.empty_like(q)
    for r in range(len(q)):
        slots = seq_slots[row_seq[r], :row_len[r]]
        keys = k_pool[slots].to(q.dtype).transpose(0, 1)[None]        # float16 pools widen exactly
        values = v_pool[slots].to(q.dtype).transpose(0, 1)[None]
        out[r] = F.scaled_dot_product_attention(q[r][None, :, None], keys, values, scale=scale,
                                                enable_gqa=True)[0, :, 0]
    return out


def _has_avx2() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), [])
    return {"avx2", "fma", "f16c"} <= set(flags)
