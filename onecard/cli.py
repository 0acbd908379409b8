"""The ``onecard`` command: ``serve | probe | plan | verify | bench | quantize``.

Contract: ``main(argv) -> int``. ``build_serve_parser()`` returns the ``serve`` argument parser and
``add_serve_arguments(parser)`` adds its arguments (vLLM's flag names and meanings) to any parser, so the
deployment tests can parse the k8s manifest's args; ``engine_args_from_namespace(ns)`` turns parsed args into
``EngineArgs``. ``serve`` validates everything before loading (``EngineArgs.create_config()``, parser names,
preflight) and exits 2 with a message naming the flag on a bad value; then the HTTP server listens at once
while the engine loads in the background. SIGTERM/SIGINT: stop accepting, finish in-flight requests
(bounded by ``--shutdown-timeout``), exit 0. Other subcommands are dispatched to their modules lazily.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from onecard.config import ConfigError, EngineArgs

logger = logging.getLogger("onecard")

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def human_int(text: str) -> int:
    """An integer, optionally with a size suffix as vLLM accepts: 65536, 64k, 64K (1024), 1g, 1Gi, 2.5G."""
    t = text.strip().replace("_", "")
    try:
        return int(t)
    except ValueError:
        pass
    low = t.lower().rstrip("b")
    for suf in sorted(_SUFFIX, key=len, reverse=True):
        if low.endswith(suf):
            num = low[: -len(suf)]
            # vLLM: lower-case k/m/g are decimal, upper-case K/M/G are binary.
            mult = _SUFFIX[suf]
            if len(suf) == 1 and t.rstrip("bB")[-1].isupper():
                mult = _SUFFIX[suf + "i"]
            try:
                return int(float(num) * mult)
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer (a suffix k, m, g is allowed)")


def _fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    bool_opt = argparse.BooleanOptionalAction
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory or hub id ORG/NAME[@REVISION]: the HF cache first, else downloaded "
                             "(default: the bundled tiny coder)")

    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None, help="same as the positional MODEL (as the deployment writes it)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients may use in `model` (default: the model argument); all are accepted")
    g.add_argument("--revision", default=None,
                   help="hub branch, tag or commit of the model (default: main; also ORG/NAME@REVISION)")
    g.add_argument("--download-dir", default=None,
                   help="hub cache folder to look in and download into (default: HF_HUB_CACHE or HF_HOME/hub)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto, float16, bfloat16 or float32 (GPTQ runs float16)")
    g.add_argument("--quantization", "-q", default=None, help="gptq (read from the checkpoint when omitted)")
    g.add_argument("--max-model-len", type=human_int, default=None,
                   help="context length, prompt + output (e.g. 65536 or 64k; default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument("--chat-template", default=None, help="a chat template file, or the template text")
    g.add_argument("--trust-remote-code", action="store_true", help="accepted for compatibility; no effect")

    g = parser.add_argument_group("KV cache")
    g.add_argument("--kv-cache-dtype", default="auto", help=
                   "auto (the serving dtype); fp8_e5m2: 1 byte per element, half the KV bytes, every card "
                   "(sm70+); fp8 = fp8_e4m3: 1 byte, sm89+, per-layer k/v scales from the checkpoint (else 1.0)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block: 8, 16, 32, 64 or 128")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="fraction of GPU memory for weights + activations + KV cache (0, 1]")
    g.add_argument("--kv-cache-memory-bytes", type=human_int, default=None,
                   help="KV cache size in bytes (e.g. 8G); overrides --gpu-memory-utilization's sizing")
    g.add_argument("--enable-prefix-caching", action=bool_opt, default=True,
                   help="reuse KV blocks of shared prompt prefixes (default on)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="testing: a fixed KV block count")
    g.add_argument("--kv-offloading-size", "--kv-offload-gib", type=_fraction, default=None, metavar="GIB",
                   help="GiB of host memory that keeps prefix blocks the GPU cache evicts, copied back on a hit "
                        "instead of recomputed (default off)")
    g.add_argument("--kv-offloading-backend", default="native", choices=["native", "lmcache"],
                   help="host tier implementation: native (onecard's; lmcache is not supported)")

    g = parser.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=256, help="maximum concurrent sequences per step")
    g.add_argument("--max-num-batched-tokens", type=human_int, default=None,
                   help="token budget per step (default 8192 with chunked prefill)")
    g.add_argument("--long-prefill-token-threshold", type=human_int, default=0,
                   help="cap on one request's new tokens per step while others run (0 = off)")
    g.add_argument("--enable-chunked-prefill", action=bool_opt, default=True,
                   help="split long prompts across steps (default on)")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="waiting requests beyond which new ones get 503 + Retry-After at once (default: "
                        "4 x --max-num-seqs, at least 64)")
    g.add_argument("--async-scheduling", action=bool_opt, default=False,
                   help="schedule the next step while the GPU runs this one (hides host time; default off)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding (default off): {"method": "ngram"|"suffix", '
                        '"num_speculative_tokens": K, "prompt_lookup_min": N, "prompt_lookup_max": N, '
                        '"suffix_decoding_...": ...}; not with --async-scheduling')

    g = parser.add_argument_group("parallelism (one GPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="must be 1")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="must be 1")

    g = parser.add_argument_group("OpenAI server")
    g.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    g.add_argument("--reasoning-parser", default=None, help="split <think> reasoning out: qwen3")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice=auto (needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", default=None, help="tool-call format: hermes or qwen3_coder")
    g.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='structured outputs: {"backend": "auto"|"xgrammar", "disable_any_whitespace": bool, '
                        '"disable_additional_properties": bool, "max_whitespace": N}')
    g.add_argument("--guided-decoding-backend", default=None,
                   help="structured outputs backend (vLLM's older flag): auto or xgrammar")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"])
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on SIGTERM")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no access-log line per request")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput line (every 10 s while busy)")
    g.add_argument("--max-request-body-bytes", type=human_int, default=None,
                   help="larger request bodies get 413 before they are read (default 8Mi; e.g. 16M)")
    g.add_argument("--api-threads", type=int, default=None,
                   help="threads that template and tokenize requests off the event loop "
                        "(default: ONECARD_API_THREADS, else min(4, CPUs))")

    g = parser.add_argument_group("runtime")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--engine-threads", type=int, default=None,
                   help="torch CPU threads in the engine process (default: ONECARD_ENGINE_THREADS, else 1 on a "
                        "GPU and half the CPUs on the CPU path)")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--single-process", action="store_true",
                   help="run the engine core in a thread of the server process (tests, debugging)")
    return parser


def build_serve_parser(prog: str = "onecard serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [MODEL] [options]",
        description="Serve a model behind an OpenAI-compatible API (vLLM's flags and defaults).",
    )
    return add_serve_arguments(parser)


class ServeArgsError(ConfigError):
    """A serve flag that cannot work (names the flag)."""


def resolve_model_arg(ns: argparse.Namespace) -> str | None:
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ServeArgsError(f"MODEL={ns.model_tag!r} and --model={ns.model!r} disagree; give one of them.")
    return ns.model or ns.model_tag


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=resolve_model_arg(ns), revision=ns.revision, download_dir=ns.download_dir,
        served_model_name=ns.served_model_name, tokenizer=ns.tokenizer,
        dtype=ns.dtype, quantization=ns.quantization, kv_cache_dtype=ns.kv_cache_dtype,
        max_model_len=ns.max_model_len, tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size, gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        enable_chunked_prefill=ns.enable_chunked_prefill, enable_prefix_caching=ns.enable_prefix_caching,
        block_size=ns.block_size, seed=ns.seed, enforce_eager=ns.enforce_eager, chat_template=ns.chat_template,
        max_num_queued_reqs=ns.max_num_queued_reqs, device=ns.device,
        num_gpu_blocks_override=ns.num_gpu_blocks_override, async_scheduling=ns.async_scheduling,
        engine_threads=ns.engine_threads, kv_offloading_size=ns.kv_offloading_size,
        kv_offloading_backend=ns.kv_offloading_backend, speculative_config=ns.speculative_config)


def check_parser_flags(ns: argparse.Namespace) -> None:
    """Parser names and the auto-tool-choice pairing, checked before anything loads."""
    from onecard import parsers

    if ns.reasoning_parser is not None:
        try:
            parsers.get_reasoning_parser(ns.reasoning_parser)
        except (KeyError, ValueError) as e:
            raise ServeArgsError(f"--reasoning-parser={ns.reasoning_parser} is unknown ({e}); use qwen3.") from None
    if ns.tool_call_parser is not None:
        try:
            parsers.get_tool_parser(ns.tool_call_parser)
        except (KeyError, ValueError) as e:
            raise ServeArgsError(
                f"--tool-call-parser={ns.tool_call_parser} is unknown ({e}); use hermes or qwen3_coder.") from None
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ServeArgsError("--enable-auto-tool-choice requires --tool-call-parser (hermes or qwen3_coder).")
    from onecard.frontend.grammar import StructuredOutputsConfig

    try:
        StructuredOutputsConfig.parse(ns.structured_outputs_config, ns.guided_decoding_backend)
    except (TypeError, ValueError) as e:
        raise ServeArgsError(str(e)) from None
    if ns.max_num_queued_reqs is not None and ns.max_num_queued_reqs < 0:
        raise ServeArgsError(f"--max-num-queued-reqs={ns.max_num_queued_reqs} must be >= 0.")
    for flag, value in (("--engine-threads", ns.engine_threads), ("--api-threads", ns.api_threads),
                        ("--max-request-body-bytes", ns.max_request_body_bytes)):
        if value is not None and value < 1:
            raise ServeArgsError(f"{flag}={value} must be at least 1.")
    if not 0 < ns.port < 65536:
        raise ServeArgsError(f"--port={ns.port} must be in 1..65535.")


def _run_preflight(engine_config: Any) -> None:
    try:
        from onecard.preflight import preflight
    except ImportError:
        return
    preflight(engine_config)


def serve(argv: list[str]) -> int:
    ns = build_serve_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_parser_flags(ns)
        config = engine_args_from_namespace(ns).create_config()
        _run_preflight(config)
        from onecard.server.launch import exit_after_fatal, prepare_server

        server = prepare_server(config, ns)
    except ConfigError as e:
        print(f"onecard serve: error: {e}", file=sys.stderr)
        return 2
    return exit_after_fatal(server.run())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = "serve, probe, plan, verify, bench, quantize"
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: onecard {{{commands.replace(', ', ',')}}} ...\n\n"
              "  serve     serve a model behind an OpenAI-compatible API (vLLM's flags)\n"
              "  probe     what this GPU can run, and why\n"
              "  plan      memory plan: weights, KV cache, concurrency at a context length\n"
              "  verify    smoke-test a running server (models, a chat per served name, health)\n"
              "  bench     benchmark a running server\n"
              "  quantize  GPTQ-quantize a model\n\n"
              "`onecard COMMAND --help` for a command's options.")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("--version", "version"):
        import onecard

        print(getattr(onecard, "__version__", "0.1.0"))
        return 0
    if cmd == "serve":
        return serve(rest)
    if cmd == "probe":
        from onecard.hardware import main_probe

        p = argparse.ArgumentParser(prog="onecard probe")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return main_probe(as_json=p.parse_args(rest).json)
    if cmd == "plan":
        from onecard.plan import main_plan

        return main_plan(rest)
    if cmd == "verify":
        from onecard.tools.verify import main as verify_main

        return verify_main(rest)
    if cmd == "bench":
        from onecard.tools.bench_serve import main as bench_main

        return bench_main(rest)
    if cmd == "quantize":
        from onecard.quant.gptq import main as quantize_main

        return quantize_main(rest)
    print(f"onecard: unknown command {cmd!r}; choose from {commands}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
