"""Engine flags come from the config dataclasses' fields: each default is the field's, aliases parse to the
same field, and flat engine arguments map onto the nested config (unknown ones are refused)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from specserve.config import (
    ENGINE_FLAGS,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpecConfig,
    add_engine_args,
    engine_config,
    engine_kwargs,
)


def parse(*argv: str, only=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, only)
    return parser.parse_args(list(argv))


def test_no_flags_give_the_default_config():
    assert engine_config(**engine_kwargs(parse())) == EngineConfig()


def test_every_flagged_field_has_one_flag_with_its_type_and_default():
    flagged = {f.name for cls in (EngineConfig, CacheConfig, SchedulerConfig, SpecConfig, ParallelConfig)
               for f in dataclasses.fields(cls) if "flags" in f.metadata}
    assert len(ENGINE_FLAGS) == len(flagged)
    names = [name for fl in ENGINE_FLAGS for name in fl.flags]
    assert len(names) == len(set(names))
    by_flag = {fl.flags[0]: fl for fl in ENGINE_FLAGS}
    assert by_flag["--page-size"].type is int and by_flag["--page-size"].default == CacheConfig().page_size
    assert by_flag["--max-model-len"].type is int and by_flag["--max-model-len"].default is None
    assert by_flag["--speculative-dspark-confidence-threshold"].type is float
    assert by_flag["--speculative-ngram-hybrid"].type is bool
    assert by_flag["--tp-size"].flags == ("--tp-size", "--tp", "--tensor-parallel-size")
    assert by_flag["--dist-init-addr"].type is str and by_flag["--dist-init-addr"].default is None


def test_flags_and_their_aliases_reach_the_config():
    for block_flag in ("--speculative-block-size", "--speculative-dspark-block-size"):
        cfg = engine_config(**engine_kwargs(parse(block_flag, "5", "--speculative-ngram-max", "6", "--threads", "2",
                                                  "--kv-cache-memory", "4096", "--disable-radix-cache")))
        assert (cfg.spec.block_size, cfg.spec.ngram_max, cfg.num_threads, cfg.cache.memory_bytes,
                cfg.cache.disable_radix_cache) == (5, 6, 2, 4096, True)
    for tp_flag in ("--tp-size", "--tp", "--tensor-parallel-size"):
        cfg = engine_config(**engine_kwargs(parse(tp_flag, "3", "--dp", "2", "--dist-init-addr", "10.0.0.1:5000")))
        assert cfg.parallel == ParallelConfig(tp_size=3, dp_size=2, dist_init_addr="10.0.0.1:5000")


def test_a_subset_of_flags():
    args = parse("--page-size", "8", only=("--page-size", "--dtype"))
    assert engine_kwargs(args) == {"dtype": "float32", "page_size": 8}
    with pytest.raises(SystemExit):
        parse("--threads", "2", only=("--page-size",))


def test_flat_arguments_map_onto_the_sections():
    cfg = engine_config("m.gguf", page_size=8, max_running_requests=3, speculative_algorithm="NGRAM", dtype="float64")
    assert (cfg.model_path, cfg.cache.page_size, cfg.scheduler.max_running_requests, cfg.spec.algorithm,
            cfg.dtype) == ("m.gguf", 8, 3, "NGRAM", "float64")
    with pytest.raises(TypeError, match="unknown engine argument 'bogus'"):
        engine_config(bogus=1)
    with pytest.raises(TypeError, match="unknown engine argument 'algorithm'"):
        engine_config(algorithm="NGRAM")      # speculative fields take their prefix
