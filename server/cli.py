"""The ``specserve`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.config import ConfigError

from .settings import ServeSettings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="OpenAI-compatible server with lossless speculative decoding"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP", argument_default=argparse.SUPPRESS)
    serve.add_argument("--config", default=None, help="YAML preset (see configs/); flags override it")
    serve.add_argument("--target", help="model folder, hub id or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--draft", help="draft model ref, copy:DTYPE (the target in another dtype), or none")
    serve.add_argument("--drafter", help="drafting strategy (default: model)")
    serve.add_argument("--num-draft-tokens", type=int, help="tokens drafted per speculative step (default 4)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--device", choices=["cpu", "cuda", "auto"])
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--max-model-len", type=int, help="context length; KV caches are sized to it once")
    serve.add_argument("--served-model-name", help="model id clients use (default: the target ref)")
    serve.add_argument("--seed", type=int, help="seed for requests that bring none")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return parser


def serve(settings: ServeSettings) -> None:
    import uvicorn

    from engine.factory import load_engine

    from .app import create_app

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at serving time
    config = settings.engine_config()
    logging.getLogger("specserve").info(
        "loading %s, draft %s, drafter %s, k=%d",
        config.target or "the embedded default",
        config.draft,
        config.drafter,
        config.num_draft_tokens,
    )
    app = create_app(lambda: load_engine(config), settings.served_model_name)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)


def main(argv: list[str] | None = None) -> None:
    args = vars(_parser().parse_args(argv))
    command, config_file = args.pop("command"), args.pop("config", None)
    try:
        settings = ServeSettings.load(config_file, args)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if command == "serve":
            serve(settings)
    except ConfigError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
