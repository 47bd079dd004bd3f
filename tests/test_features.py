"""The feature cache: its rows are the target pass's (in float16), an interrupted build resumes to the same files, and
its key changes with everything the rows depend on."""
from __future__ import annotations

import pytest
import torch

from specserve.quantization import INT8_SCHEME
from specserve.train.features import FeatureCache, TargetPass
from specserve.train.trainer import sequence, usable_examples

LAYERS = (0, 1)


@pytest.fixture(scope="module")
def sequences(tiny_answers) -> list[list[int]]:
    return [sequence(e) for e in usable_examples(tiny_answers, 128)[:9]]


def build(tiny_llama, sequences, root, quantization="none", **kw) -> FeatureCache:
    run = TargetPass(tiny_llama, LAYERS, 8, quantization, torch.float64)
    return FeatureCache.build(root, FeatureCache.key(tiny_llama, run, quantization), sequences, run, **kw)


def test_cached_rows_are_the_target_pass_in_float16(tiny_llama, sequences, tmp_path):
    cache = build(tiny_llama, sequences, tmp_path, tokens_per_pass=40)
    want = TargetPass(tiny_llama, LAYERS, 8, "none", torch.float64)([sequences[4], sequences[0]])
    got = cache.read([4, 0])
    assert got.aux.dtype == torch.float64 and got.aux.shape == want.aux.shape
    as_stored = cache.read([4, 0], torch.float16)      # what a GPU run copies over and widens there
    assert as_stored.aux.dtype == torch.float16 and torch.equal(as_stored.aux.double(), got.aux)
    # at most one float16 step apart: the passes batch the sequences differently
    torch.testing.assert_close(got.aux, want.aux, rtol=2 ** -10, atol=2 ** -24)
    assert torch.equal(got.top_ids, want.top_ids)
    torch.testing.assert_close(got.top_probs, want.top_probs, rtol=2 ** -10, atol=2 ** -24)
    # the k probabilities are the target's likeliest, in order, and the padding stays zero
    assert (got.top_probs[..., :-1] >= got.top_probs[..., 1:]).all()
    assert not got.aux[1, len(sequences[0]):].any()


def test_an_interrupted_build_resumes_to_the_same_files(tiny_llama, sequences, tmp_path, monkeypatch):
    straight = build(tiny_llama, sequences, tmp_path / "straight", tokens_per_pass=40)
    calls = 0
    original = TargetPass.__call__

    def failing(self, batch):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setattr(TargetPass, "__call__", failing)
    with pytest.raises(KeyboardInterrupt):
        build(tiny_llama, sequences, tmp_path / "resumed", tokens_per_pass=40)
    monkeypatch.setattr(TargetPass, "__call__", original)
    resumed = build(tiny_llama, sequences, tmp_path / "resumed", tokens_per_pass=40)
    assert resumed.folder.name == straight.folder.name
    for name in ("features.bin", "top_ids.bin", "top_probs.bin"):
        assert (resumed.folder / name).read_bytes() == (straight.folder / name).read_bytes(), name
    assert not (resumed.folder / "progress.json").exists()


def test_the_key_changes_with_what_the_rows_depend_on_besides_tokens(tiny_llama):
    def key(quantization="none", layers=LAYERS, top_k=8, kv_cache_dtype="auto"):
        return FeatureCache.key(tiny_llama, TargetPass(tiny_llama, layers, top_k, quantization, torch.float32,
                                                       kv_cache_dtype), quantization)

    base = key()
    assert key() == base
    assert all(k != base for k in (key(quantization="int8"), key(layers=(1,)), key(top_k=4),
                                   key(kv_cache_dtype="float64")))
    assert INT8_SCHEME in key(quantization="int8")["quantization"], "a cache of another int8 scheme is not reused"


def test_a_larger_set_computes_only_its_new_sequences(tiny_llama, sequences, tmp_path, monkeypatch):
    first = build(tiny_llama, sequences[:4], tmp_path)
    computed = []
    original = TargetPass.__call__
    monkeypatch.setattr(TargetPass, "__call__", lambda self, batch: computed.extend(batch) or original(self, batch))
    grown = build(tiny_llama, [sequences[5], *sequences[:4], sequences[5], sequences[6]], tmp_path)
    assert grown.folder == first.folder and computed == [sequences[5], sequences[6]]
    assert grown.spans[1:5] == first.spans and grown.spans[0] == grown.spans[5]
    assert torch.equal(grown.read([1, 2]).aux, first.read([0, 1]).aux)


def test_the_target_attends_in_the_dtype_the_engine_serves_it_with(tiny_llama):
    """int8: a float16 cache; float32 without int8: float32; float64 compute: float64 attention; unless
    --kv-cache-dtype says otherwise."""
    assert TargetPass(tiny_llama, LAYERS, 8, "int8", torch.float32).kv_geometry.dtype == torch.float16
    assert TargetPass(tiny_llama, LAYERS, 8, "none", torch.float32).kv_geometry.dtype == torch.float32
    assert TargetPass(tiny_llama, LAYERS, 8, "none", torch.float64).kv_geometry.dtype == torch.float64
    assert TargetPass(tiny_llama, LAYERS, 8, "int8", torch.float32, "float64").kv_geometry.dtype == torch.float64


def full_key(tiny_llama) -> dict:
    return FeatureCache.key(tiny_llama, TargetPass(tiny_llama, LAYERS, 8, "none", torch.float64), "none")


def test_a_cache_of_more_layers_serves_a_drafter_of_fewer(tiny_llama, sequences, tmp_path, monkeypatch):
    """EAGLE's 3 target layers are among a block drafter's 5: a run on fewer layers reads their columns from the
    stored cache instead of running the target again; a cache of other layers or other numerics is no cover."""
    full = build(tiny_llama, sequences[:4], tmp_path)
    one = FeatureCache.key(tiny_llama, TargetPass(tiny_llama, (1,), 8, "none", torch.float64), "none")
    zero = FeatureCache.key(tiny_llama, TargetPass(tiny_llama, (0,), 8, "none", torch.float64), "none")
    assert FeatureCache.covering(tmp_path, one, sequences[:4]) == full_key(tiny_llama)
    assert FeatureCache.covering(tmp_path, {**one, "top_k": 4}, sequences[:4]) == {**one, "top_k": 4}
    assert FeatureCache.covering(tmp_path / "empty", one, sequences[:4]) == one
    assert FeatureCache.covering(tmp_path, one, sequences[6:]) == one, "it holds none of these sequences"
    # a cache of the exact layers wins unless a covering one holds more of the sequences
    FeatureCache.build(tmp_path, zero, sequences[:2], TargetPass(tiny_llama, (0,), 8, "none", torch.float64))
    assert FeatureCache.covering(tmp_path, zero, sequences[:2]) == zero
    assert FeatureCache.covering(tmp_path, zero, sequences[:4]) == full_key(tiny_llama)
    FeatureCache.build(tmp_path, one, sequences[5:7], TargetPass(tiny_llama, (1,), 8, "none", torch.float64))
    assert FeatureCache.covering(tmp_path, zero, sequences[5:7]) == zero, "layer 1 alone does not cover layer 0"
    computed = []
    original = TargetPass.__call__
    monkeypatch.setattr(TargetPass, "__call__", lambda self, batch: computed.extend(batch) or original(self, batch))
    run = TargetPass(tiny_llama, LAYERS, 8, "none", torch.float64)
    cache = FeatureCache.build(tmp_path, FeatureCache.covering(tmp_path, one, sequences[:4]), sequences[:4],
                               run).select((1,))
    assert cache.folder == full.folder and computed == []
    want = original(TargetPass(tiny_llama, (1,), 8, "none", torch.float64), [sequences[2], sequences[0]])
    got = cache.read([2, 0])
    assert got.aux.shape == want.aux.shape
    torch.testing.assert_close(got.aux, want.aux, rtol=2 ** -10, atol=2 ** -24)
    assert torch.equal(got.top_ids, want.top_ids)
    with pytest.raises(ValueError, match="holds target layers"):
        full.select((0, 2))


def gpu_path(run: TargetPass) -> TargetPass:
    """The pass as it runs off the CPU (padded SDPA through metadata moved to its device), here on the CPU."""
    run.row_kernel = False
    return run


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_gpu_path_computes_the_row_kernels_features(tiny_llama, sequences, quantization):
    """A GPU runs the pass without the row kernel (CPU code): padded SDPA calls, in float32 over the float16 pool
    as the kernel attends, and the ops' references. On the CPU that path gives the row kernel's features up to
    float32 rounding."""
    batch = [sequences[3], sequences[0], sequences[7]]
    want = TargetPass(tiny_llama, LAYERS, 8, quantization, torch.float32)(batch)
    got = gpu_path(TargetPass(tiny_llama, LAYERS, 8, quantization, torch.float32))(batch)
    assert got.aux.shape == want.aux.shape and got.aux.dtype == want.aux.dtype
    torch.testing.assert_close(got.aux, want.aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.top_probs, want.top_probs, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.top_ids[..., 0], want.top_ids[..., 0])
    assert not got.aux[1, len(sequences[0]):].any(), "the padding stays zero"


def test_features_from_off_the_cpu_are_cached_apart(tiny_llama):
    """Rows computed through the GPU's path round differently: they go under their own key."""
    cpu = FeatureCache.key(tiny_llama, TargetPass(tiny_llama, LAYERS, 8, "int8", torch.float32), "int8")
    gpu = FeatureCache.key(tiny_llama, gpu_path(TargetPass(tiny_llama, LAYERS, 8, "int8", torch.float32)), "int8")
    assert "device" not in cpu and gpu == {**cpu, "device": "cpu"}


def test_an_int8_pool_off_the_cpu_is_refused(tiny_llama):
    """The padded path reads float pools only; an int8 pool's rows are values and scale bytes."""
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 features need the CPU"):
        TargetPass(tiny_llama, LAYERS, 8, "int8", torch.float32, "int8", device="meta")


def test_the_pass_off_the_cpu_stays_on_its_device(tiny_llama, sequences):
    """The meta device stands in for a GPU (values are not computed; an op mixing a CPU tensor with a meta one fails
    as it would with a CUDA one): the model, its KV pool, the metadata and the ops all run on the pass's device."""
    run = TargetPass(tiny_llama, LAYERS, 8, "int8", torch.float32, device="meta")
    assert not run.row_kernel
    aux, top_ids, top_probs = run.unpadded([sequences[1], sequences[2]])
    tokens = len(sequences[1]) + len(sequences[2])
    assert all(t.device.type == "meta" for t in (aux, top_ids, top_probs))
    assert aux.shape == (tokens, len(LAYERS) * tiny_llama.config.hidden_size) and top_ids.shape == (tokens, 8)
