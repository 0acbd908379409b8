"""One option table (issue 26): `serve`, `plan` and `LLM(...)` take the same options and resolve them through the
same `create_config`, so they cannot disagree.

References: the deployment's own command line as README.md writes it (parsed out of README, not copied), the
`plan --help` text a user reads, and a plain `LLM(...)` call spelling the same options as keyword arguments.
"""
from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import fields, replace
from pathlib import Path

import pytest

from onecard import cli
from onecard.checkpoint_meta import read_checkpoint_meta
from onecard.config import (
    DeviceSpec,
    EngineArgs,
    Env,
    ServerConfig,
    add_serve_arguments,
    create_config,
    default_max_num_batched_tokens,
)
from onecard.llm import LLM
from onecard.options import add_arguments, option
from onecard.plan import GPUS, build_plan_parser, engine_args_of, plan
from tests.unit._sparse_ckpt import qwen3_coder_30b

README = Path(__file__).resolve().parents[2] / "README.md"
H100 = GPUS["H100-80GB"]


def readme_deployment() -> list[str]:
    """The `onecard serve MODEL flags...` command of README's "Serving the team's model" section, as argv."""
    text = README.read_text()
    m = re.search(r"^ {4}onecard serve (.+?)(?:\n\n)", text, re.DOTALL | re.MULTILINE)
    assert m, "README lost its deployment command"
    return shlex.split(m.group(1).replace("\\\n", " "))


# What a user of vLLM's offline API writes for the same deployment (the server-only flags have no LLM kwarg).
LLM_KWARGS = dict(served_model_name=["coder", "reasoning"], quantization="gptq", dtype="float16",
                  kv_cache_dtype="auto", max_model_len=65536, tensor_parallel_size=1, pipeline_parallel_size=1,
                  gpu_memory_utilization=0.90, max_num_seqs=16, max_num_batched_tokens=8192,
                  long_prefill_token_threshold=2048, enable_chunked_prefill=True, enable_prefix_caching=True)
SERVER_ONLY = {"reasoning_parser": "qwen3", "enable_auto_tool_choice": True, "tool_call_parser": "hermes",
               "host": "0.0.0.0", "port": 8080}


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """The deployment's checkpoint as metadata (config + GPTQ config + safetensors headers, no tensor data)."""
    return qwen3_coder_30b(tmp_path_factory.mktemp("options") / "coder", "gptq")


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def test_every_serve_flag_is_in_plan_help_with_the_same_default(capsys):
    serve, plan_parser = _actions(cli.build_serve_parser()), _actions(build_plan_parser())
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert len(serve) >= 50
    for flag, action in serve.items():
        assert flag in plan_parser, f"plan lacks serve's {flag}"
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", help_text), f"{flag} missing from `plan --help`"
        other = plan_parser[flag]
        assert (other.dest, other.default, other.type, other.nargs, other.choices) == \
            (action.dest, action.default, action.type, action.nargs, action.choices), flag
    # the parsed defaults agree as well (positional MODEL included)
    assert {k: v for k, v in vars(build_plan_parser().parse_args([])).items() if k not in ("gpu", "gpu_memory_gib",
            "json")} == vars(cli.build_serve_parser().parse_args([]))


def test_the_table_declares_each_flag_once():
    """Every serve flag comes from one field of EngineArgs or ServerConfig (or is the positional MODEL)."""
    parser = cli.build_serve_parser()
    table = {f.name for cls in (EngineArgs, ServerConfig) for f in fields(cls)}
    dests = [a.dest for a in parser._actions if a.dest not in ("help", "model_tag")]
    assert sorted(dests) == sorted(table)
    assert len(set(dests)) == len(dests)
    # aliases the deployments and vLLM users spell
    a = _actions(parser)
    for alias, canonical in (("--kv-offload-gib", "--kv-offloading-size"), ("-tp", "--tensor-parallel-size"),
                             ("-pp", "--pipeline-parallel-size"), ("-q", "--quantization")):
        assert a[alias] is a[canonical]
    for flag in ("--guided-decoding-backend", "--structured-outputs-config", "--no-enable-prefix-caching",
                 "--no-enable-chunked-prefill", "--no-async-scheduling"):
        assert flag in a


def test_readme_deployment_resolves_identically_through_serve_llm_and_plan(coder):
    argv = readme_deployment()
    model, flags = argv[0], argv[1:]
    assert model == "ModelCloud/Qwen3-Coder-30B-A3B-Instruct-GPTQMODEL-W4A16-A"
    # The kwargs above spell exactly the README's engine flags; the rest are server options.
    ns = cli.build_serve_parser().parse_args([str(coder), *flags])
    engine_flags = {f.name for f in fields(EngineArgs) if getattr(ns, f.name) != f.default}
    assert engine_flags - {"model"} <= set(LLM_KWARGS)
    server = ServerConfig.from_namespace(ns)
    assert {k: getattr(server, k) for k in SERVER_ONLY} == SERVER_ONLY
    cli.check_parser_flags(ns)

    # serve: the parser's namespace -> EngineArgs -> create_config (on a GPU, as the deployment runs)
    ns.device = "cuda"
    serve_args = cli.engine_args_from_namespace(ns)
    serve_cfg = serve_args.create_config()
    # LLM(model, **kwargs): the same call path LLM.__init__ takes, without loading the weights
    llm_args, llm_cfg = LLM.config_for(str(coder), device="cuda", **LLM_KWARGS)
    assert llm_args == serve_args
    assert llm_cfg == serve_cfg
    # plan: its own parser (serve's flags + --gpu) and the same create_config for the card
    plan_ns = build_plan_parser().parse_args([str(coder), *flags, "--gpu", H100.name])
    plan_args = engine_args_of(plan_ns)
    assert plan_args == replace(serve_args, device="auto")           # the plan is for a GPU whatever --device says
    plan_cfg = create_config(plan_args, read_checkpoint_meta(coder, with_tensors=False), DeviceSpec("cuda", H100.cc),
                             Env.read())
    assert plan_cfg == serve_cfg
    report = plan(str(coder), plan_ns, gpu_name=H100.name)
    assert report.ok, report.reasons
    m, s, c = serve_cfg.model, serve_cfg.scheduler, serve_cfg.cache
    assert (report.dtype, report.max_model_len, report.max_num_seqs, report.max_num_batched_tokens,
            report.block_size, report.gpu_memory_utilization) == \
        (m.dtype, m.max_model_len, s.max_num_seqs, s.max_num_batched_tokens, c.block_size, c.gpu_memory_utilization)
    assert (m.dtype, m.max_model_len, s.max_num_batched_tokens, s.long_prefill_token_threshold) == \
        ("float16", 65536, 8192, 2048)
    assert m.served_model_names == ["coder", "reasoning"] and m.quant is not None


def test_serve_and_plan_agree_on_derived_defaults(tmp_path):
    """No flags: the batched-token budget, the dtype and the context length come from one rule each."""
    bf16 = qwen3_coder_30b(tmp_path / "bf16", "bf16", max_position_embeddings=4096)
    for extra, chunked in (([], True), (["--no-enable-chunked-prefill"], False)):
        ns = cli.build_serve_parser().parse_args([str(bf16), "--device", "cuda", "--dtype", "float16", *extra])
        cfg = cli.engine_args_from_namespace(ns).create_config()
        report = plan(str(bf16), build_plan_parser().parse_args([str(bf16), "--dtype", "float16", *extra]),
                      gpu_name="V100-32GB")
        assert cfg.scheduler.max_num_batched_tokens == report.max_num_batched_tokens == \
            default_max_num_batched_tokens(chunked, 4096)
        assert cfg.model.max_model_len == report.max_model_len == 4096
    # --dtype auto of a bf16 checkpoint on a V100: float16 for serve (vLLM's fallback) and for the plan alike
    meta = read_checkpoint_meta(bf16, with_tensors=False)
    v100 = create_config(EngineArgs(model=str(bf16)), meta, DeviceSpec("cuda", (7, 0)), Env.read())
    h100 = create_config(EngineArgs(model=str(bf16)), meta, DeviceSpec("cuda", (9, 0)), Env.read())
    assert (v100.model.dtype, h100.model.dtype) == ("float16", "bfloat16")
    assert plan(str(bf16), None, gpu_name="V100-32GB").dtype == "float16"
    assert plan(str(bf16), None, gpu_name="H200").dtype == "bfloat16"


def test_generated_arguments_follow_the_annotations():
    """A new option is one field: its flag, type, negation and group come from the declaration."""
    from dataclasses import dataclass

    @dataclass
    class Extra:
        speculative_tokens: int | None = option(None, "--speculative-tokens", group="scheduler", help="n")
        flag_on: bool = option(True, "--flag-on", group="runtime", negatable=True, help="b")
        names: list[str] | None = option(None, "--names", group="model", help="l")  # noqa: RUF009

    p = add_arguments(argparse.ArgumentParser(), Extra)
    ns = p.parse_args(["--speculative-tokens", "3", "--no-flag-on", "--names", "a", "b"])
    assert (ns.speculative_tokens, ns.flag_on, ns.names) == (3, False, ["a", "b"])
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-tokens", "x"])
    with pytest.raises(ValueError, match="group"):
        option(1, "--x", group="nope")
    assert add_serve_arguments(argparse.ArgumentParser()).parse_args(["--port=1"]).port == 1


def test_async_scheduling_default_follows_device_not_speculation():
    """--async-scheduling unset: on for a GPU (with --speculative-config too: the hybrid loop), off on the CPU
    path; an explicit --no-async-scheduling / --async-scheduling wins, with or without speculation (the pure
    create_config, no GPU needed)."""
    coder = str(Path(cli.__file__).parent / "data" / "onecard-tiny-coder")
    meta = read_checkpoint_meta(coder, with_tensors=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3}

    def cfg(device: str, **kw):
        return create_config(EngineArgs(model=coder, **kw), meta, DeviceSpec(device, (9, 0)), Env.read())

    assert cfg("cuda").scheduler.async_scheduling is True
    assert cfg("cpu").scheduler.async_scheduling is False
    assert cfg("cuda", speculative_config=spec).scheduler.async_scheduling is True
    assert cfg("cpu", speculative_config=spec).scheduler.async_scheduling is False
    assert cfg("cuda", speculative_config=spec, async_scheduling=False).scheduler.async_scheduling is False
    assert cfg("cpu", speculative_config=spec, async_scheduling=True).scheduler.async_scheduling is True
    assert cfg("cuda", async_scheduling=False).scheduler.async_scheduling is False
    assert cfg("cpu", async_scheduling=True).scheduler.async_scheduling is True
    ns = cli.build_serve_parser().parse_args([coder, "--no-async-scheduling"])
    assert ns.async_scheduling is False and cli.build_serve_parser().parse_args([coder]).async_scheduling is None
