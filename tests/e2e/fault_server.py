"""A real server process for fault tests: ``python -m tests.e2e.fault_server TOKENIZER_DIR PORT [options]``.

The engine core runs in its own spawned process (the default ``ProcessCoreClient``) with a scripted runner
(``scripted_process_core``: real scheduler and KV cache, no weights), so tests can kill it with SIGKILL or
send the server SIGTERM and watch what clients and the exit status see. Logs go to stderr.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("tokenizer_dir")
    p.add_argument("port", type=int)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from onecard.frontend.core_client import ProcessCoreClient
    from onecard.server.launch import Server, exit_after_fatal, make_state, settings_from
    from onecard.vocab import load_tokenizer
    from tests.e2e.harness import scripted_engine_config
    from tests.e2e.scripted import scripted_process_core

    tok = load_tokenizer(ns.tokenizer_dir)
    config = scripted_engine_config(Path(ns.tokenizer_dir), tok, max_model_len=1024)
    reply = tok.encode("Hello there, friend.", add_special_tokens=False)
    core = ProcessCoreClient(config, core_factory=functools.partial(scripted_process_core, reply_ids=reply,
                                                                    step_delay=ns.step_delay))
    core.start()
    state = make_state(config, core, settings_from(config), tok)
    server = Server(state, "127.0.0.1", ns.port, shutdown_timeout=ns.shutdown_timeout, log_level="info")
    return exit_after_fatal(server.run())


if __name__ == "__main__":
    sys.exit(main())
