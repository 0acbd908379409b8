"""`onecard serve` flags: the deployment's args parse as written into EngineArgs; values that cannot work
fail before loading with exit 2 and a message naming the flag; --help is grouped."""
from __future__ import annotations

import argparse
import shlex

import pytest

from onecard import cli

DEPLOYMENT = ("--model=Qwen/Qwen3-Coder --served-model-name coder reasoning --quantization=gptq --dtype=float16 "
              "--kv-cache-dtype=auto --max-model-len=65536 --tensor-parallel-size=1 --pipeline-parallel-size=1 "
              "--gpu-memory-utilization=0.90 --max-num-seqs=16 --max-num-batched-tokens=8192 "
              "--long-prefill-token-threshold=2048 --enable-chunked-prefill --enable-prefix-caching "
              "--reasoning-parser=qwen3 --enable-auto-tool-choice --tool-call-parser=hermes --host=0.0.0.0 "
              "--port=8080")


def test_deployment_args_parse_as_written():
    ns = cli.build_serve_parser().parse_args(shlex.split(DEPLOYMENT))
    ea = cli.engine_args_from_namespace(ns)
    assert ea.model == "Qwen/Qwen3-Coder"
    assert ea.served_model_name == ["coder", "reasoning"]
    assert (ea.quantization, ea.dtype, ea.kv_cache_dtype) == ("gptq", "float16", "auto")
    assert (ea.max_model_len, ea.max_num_seqs, ea.max_num_batched_tokens) == (65536, 16, 8192)
    assert ea.long_prefill_token_threshold == 2048 and ea.gpu_memory_utilization == 0.9
    assert ea.enable_chunked_prefill and ea.enable_prefix_caching
    assert (ns.reasoning_parser, ns.tool_call_parser, ns.enable_auto_tool_choice) == ("qwen3", "hermes", True)
    assert (ns.host, ns.port) == ("0.0.0.0", 8080)
    cli.check_parser_flags(ns)   # the parser names exist


def test_other_flags_and_defaults():
    p = cli.build_serve_parser()
    ns = p.parse_args([])
    assert ns.port == 8000 and cli.resolve_model_arg(ns) is None
    ns = p.parse_args(["/m", "--no-enable-prefix-caching", "--api-key", "k", "--block-size", "32", "--seed", "3",
                       "--enforce-eager", "--kv-cache-memory-bytes", "2G", "--chat-template", "t.jinja",
                       "--max-num-queued-reqs", "4", "--single-process", "--no-enable-chunked-prefill"])
    ea = cli.engine_args_from_namespace(ns)
    assert ea.model == "/m" and not ea.enable_prefix_caching and not ea.enable_chunked_prefill
    assert (ea.block_size, ea.seed, ea.enforce_eager) == (32, 3, True)
    assert ea.kv_cache_memory_bytes == 2 * 2**30 and ea.chat_template == "t.jinja" and ea.max_num_queued_reqs == 4
    assert ns.api_key == "k" and ns.single_process


def test_add_serve_arguments_on_any_parser():
    p = cli.add_serve_arguments(argparse.ArgumentParser())
    assert p.parse_args(["--port=1"]).port == 1


@pytest.mark.parametrize("text,value", [("65536", 65536), ("64k", 64000), ("64K", 65536), ("1g", 10**9),
                                        ("1Gi", 2**30), ("2.5G", int(2.5 * 2**30))])
def test_human_int(text, value):
    assert cli.human_int(text) == value


def test_model_positional_and_flag_must_agree():
    ns = cli.build_serve_parser().parse_args(["a/b", "--model=c/d"])
    with pytest.raises(cli.ServeArgsError, match="disagree"):
        cli.resolve_model_arg(ns)


@pytest.mark.parametrize("flag,named", [
    ("--tensor-parallel-size=2", "--tensor-parallel-size=2"),
    ("--pipeline-parallel-size=2", "--pipeline-parallel-size=2"),
    ("--kv-cache-dtype=int4", "--kv-cache-dtype=int4"),
    ("--reasoning-parser=nope", "--reasoning-parser=nope"),
    ("--tool-call-parser=nope", "--tool-call-parser=nope"),
    ("--enable-auto-tool-choice", "--enable-auto-tool-choice requires --tool-call-parser"),
    ("--block-size=7", "--block-size=7"),
    ("--gpu-memory-utilization=1.5", "--gpu-memory-utilization=1.5"),
    ("--kv-offloading-size=0", "--kv-offloading-size=0"),
    ("--kv-offloading-backend=lmcache", "--kv-offloading-backend=lmcache"),
])
def test_bad_values_fail_at_start_naming_the_flag(tiny_tokenizer_dir, tiny_moe_gptq_dir, flag, named, capsys):
    rc = cli.main(["serve", str(tiny_moe_gptq_dir), "--device=cpu", flag])
    assert rc == 2
    assert named in capsys.readouterr().err


def test_help_is_grouped(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for group in ("model:", "KV cache:", "scheduler:", "OpenAI server:", "runtime:"):
        assert group in out
    assert "--served-model-name" in out and "--tool-call-parser" in out
    assert cli.main([]) == 2 and cli.main(["--help"]) == 0
    assert cli.main(["frobnicate"]) == 2


def test_kv_offloading_flags_parse():
    """vLLM's --kv-offloading-size (GiB, float) and the issue's --kv-offload-gib spelling; off by default."""
    parse = cli.build_serve_parser().parse_args
    assert cli.engine_args_from_namespace(parse([])).kv_offloading_size is None
    for argv in (["--kv-offloading-size", "2.5"], ["--kv-offload-gib=2.5"]):
        ea = cli.engine_args_from_namespace(parse(argv + ["--kv-offloading-backend", "native"]))
        assert (ea.kv_offloading_size, ea.kv_offloading_backend) == (2.5, "native")
