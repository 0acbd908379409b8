"""The ``onecard`` command: ``serve | probe | plan | verify | bench | quantize``.

Contract: ``main(argv) -> int``. ``build_serve_parser()`` returns the ``serve`` argument parser, generated
from the option table (``onecard.config``: ``EngineArgs`` + ``ServerConfig``, vLLM's flag names and meanings;
``add_serve_arguments(parser)`` adds them to any parser, so the deployment tests can parse the k8s manifest's
args); ``engine_args_from_namespace(ns)`` turns parsed args into ``EngineArgs``. ``serve`` validates
everything before loading (``check_parser_flags``, ``EngineArgs.create_config()``, preflight) and exits 2 with
a message naming the flag on a bad value; then the HTTP server listens at once while the engine loads in the
background. SIGTERM/SIGINT: stop accepting, finish in-flight requests
(bounded by ``--shutdown-timeout``), exit 0. Other subcommands are dispatched to their modules lazily.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from onecard.config import (
    ConfigError,
    EngineArgs,
    ServeArgsError,
    ServerConfig,
    add_serve_arguments,
    model_argument,
)
from onecard.options import human_int  # noqa: F401 - re-exported (scripts and tests parse sizes with it)

logger = logging.getLogger("onecard")


def build_serve_parser(prog: str = "onecard serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [MODEL] [options]",
        description="Serve a model behind an OpenAI-compatible API (vLLM's flags and defaults).",
    )
    return add_serve_arguments(parser)


def resolve_model_arg(ns: argparse.Namespace) -> str | None:
    return model_argument(ns)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs.from_namespace(ns)


def check_parser_flags(ns: argparse.Namespace) -> None:
    """The server options (parser names against their registries, the auto-tool-choice pairing, structured
    outputs), checked before anything loads; the engine options are ``EngineArgs.validate``'s."""
    from onecard import parsers

    server = ServerConfig.from_namespace(ns)
    if server.reasoning_parser is not None:
        try:
            parsers.get_reasoning_parser(server.reasoning_parser)
        except (KeyError, ValueError) as e:
            raise ServeArgsError(
                f"--reasoning-parser={server.reasoning_parser} is unknown ({e}); use qwen3.") from None
    if server.tool_call_parser is not None:
        try:
            parsers.get_tool_parser(server.tool_call_parser)
        except (KeyError, ValueError) as e:
            raise ServeArgsError(f"--tool-call-parser={server.tool_call_parser} is unknown ({e}); use hermes or "
                                 "qwen3_coder.") from None
    server.validate()
    from onecard.frontend.grammar import StructuredOutputsConfig

    try:
        StructuredOutputsConfig.parse(server.structured_outputs_config, server.guided_decoding_backend)
    except (TypeError, ValueError) as e:
        raise ServeArgsError(str(e)) from None
    try:
        EngineArgs.from_namespace(ns).validate()
    except ConfigError as e:
        raise ServeArgsError(str(e)) from None


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

        server = prepare_server(config, ServerConfig.from_namespace(ns))
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
        from onecard.quant.cli import main as quantize_main

        return quantize_main(rest)
    print(f"onecard: unknown command {cmd!r}; choose from {commands}.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
