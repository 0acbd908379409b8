"""Client-side tools that talk to a running server over HTTP: ``verify`` (smoke test) and ``bench_serve``.

Contract: each module exposes ``main(argv: list[str]) -> int`` (the process exit status); the CLI
dispatches ``onecard verify`` / ``onecard bench`` to them. Nothing here imports torch or the engine.
"""
