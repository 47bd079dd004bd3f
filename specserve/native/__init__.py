"""The project's C++ ops (`torch.ops.specserve.*`): the row-invariant attention, alone or with the rotary and the
K/V write before it (rows.cpp), the int8 linear (int8_linear.cpp), the rows' argmax of greedy sampling (argmax.cpp)
and DSPARK's greedy Markov chain over the two (markov.cpp);
their schemas and references are in ops.py. stack.cpp composes the first two into a whole decoder stack's forward,
a class (`torch.classes.specserve.DecoderStack`), and context.cpp into a block drafter's context write
(`draft_context`): both exist only where the kernels are compiled, and their callers take the Python path elsewhere.

They are compiled together for this machine on first use (gcc and ninja, explicit -mavx2 -mfma -mf16c rather than
-march=native) into torch's extension cache; `make` does it at install. The int8 linear's AVX-512 VNNI path and the
attention's AVX-512 path are compiled in as well, under function target attributes: the first runs only for weights
packed for it (`vnni()`), the second wherever the CPU has AVX-512 (checked in the kernel).
Where they cannot be built (no compiler, a CPU without AVX2), or SPECSERVE_NATIVE=0 says not to (a machine that only
trains drafters on its GPU), each op is registered with its Python reference instead: row-invariant too, but slow.
The references also serve CUDA tensors, for the drafter trainer's target pass on a GPU (train/features.py), which
needs the int8 linear and little else."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.native import ops

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("rows.cpp", "int8_linear.cpp", "argmax.cpp", "markov.cpp", "stack.cpp", "context.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "kernels.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]   # no FMA the source did not write


def header_flag() -> str:
    """A define naming the headers' contents: torch rebuilds an extension when its sources or flags change, and
    hashes no header, so a change to simd.h alone would otherwise load the stale build."""
    digest = hashlib.sha1(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    return f"-DSPECSERVE_HEADERS={digest}"


def references() -> dict[str, tuple[str, Callable]]:
    """op name → (schema, the Python function computing what its kernel computes)."""
    return {"paged_attention_rows": (ops.PAGED_ATTENTION_ROWS, ops.paged_attention_rows),
            "paged_attention_qkv": (ops.PAGED_ATTENTION_QKV, ops.paged_attention_qkv),
            "int8_linear": (ops.INT8_LINEAR, ops.int8_linear),
            "quantize_kv": (ops.QUANTIZE_KV, ops.quantize_kv),
            "argmax_rows": (ops.ARGMAX_ROWS, ops.argmax_rows),
            "markov_greedy": (ops.MARKOV_GREEDY, ops.markov_greedy)}


@functools.cache
def register() -> bool:
    """Make the ops exist (once per process); True when they run the compiled kernels."""
    if os.environ.get("SPECSERVE_NATIVE", "1") == "0":
        log.info("SPECSERVE_NATIVE=0: the ops run their Python references")
    elif has_avx2():
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        try:
            load(name="specserve_native", sources=[str(s) for s in SOURCES], is_python_module=False, verbose=False,
                 extra_cflags=[*CFLAGS, header_flag()], extra_ldflags=["-fopenmp"])
            log.info("native kernels ready in %.1f s", time.perf_counter() - start)
            _register_references(compiled=True)
            return True
        except Exception as exc:      # no compiler, no ninja, a failed build
            log.warning("could not build the native kernels (%s): attention and int8 linears run the slow "
                        "references; --kv-cache-dtype float64 may be faster", exc)
    else:
        log.warning("this CPU lacks AVX2, FMA or F16C: attention and int8 linears run the slow references")
    _register_references(compiled=False)
    return False


# ops whose references compute shapes from shapes alone, so that they serve meta tensors too (the tests' stand-in
# for a GPU: tests/test_features.py)
SHAPE_ONLY = ("int8_linear", "quantize_kv", "argmax_rows")


def _register_references(compiled: bool) -> None:
    """The references as the ops' CUDA kernels, and as their CPU kernels too where none was compiled."""
    library = torch.library.Library("specserve", "IMPL" if compiled else "DEF")
    for name, (signature, reference) in references().items():
        if not compiled:
            library.define(signature)
            library.impl(name, reference, "CPU")
        library.impl(name, reference, "CUDA")
        if name in SHAPE_ONLY:
            library.impl(name, reference, "Meta")
    _libraries.append(library)        # the registration lasts as long as the Library object


_libraries: list[torch.library.Library] = []


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    return set(next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                     if line.startswith("flags")), []))


def has_avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_flags()


@functools.cache
def vnni() -> bool:
    """Whether int8 weights are packed for the kernel's AVX-512 VNNI path: the kernels are built and the CPU has it."""
    return register() and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= cpu_flags()
