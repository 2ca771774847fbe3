"""The ``specserve`` command line."""

from __future__ import annotations

import argparse
import difflib
import errno
import gc
import json
import logging
import os
import socket
import sys

from engine.cpu.threads import set_wait_policy

# Both are read once, when the hub library and OpenMP load: set them before anything imports torch.
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub; models come from disk
os.environ.setdefault("TQDM_DISABLE", "1")  # no library's bars; specserve's loading bar turns itself on
set_wait_policy()

from engine.config import ConfigError, Eagle3Training  # noqa: E402  (loads no torch)

from .logs import configure_logging  # noqa: E402
from .settings import ServeSettings, add_arguments  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    # no abbreviations: a flag's prefix (--max-model) is a mistake to report, not a flag to guess
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="OpenAI-compatible server with lossless speculative decoding",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve a model over HTTP", argument_default=argparse.SUPPRESS, allow_abbrev=False
    )
    serve.add_argument(
        "--config", default=None, help="YAML preset (see configs/; or SPECSERVE_CONFIG); flags override it"
    )
    add_arguments(serve)  # one flag per setting, from ServeSettings
    chat = commands.add_parser(
        "chat", help="chat with a running server from the terminal (streams replies)", allow_abbrev=False
    )
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="server address (default %(default)s)")
    chat.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"), help="key, if the server wants one")
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    chat.add_argument("--max-tokens", type=int, default=None, help="longest reply (default: the server's)")
    chat.add_argument("--drafter", default=None, help="ask for this drafter (default: the server's)")
    medusa = commands.add_parser("train-medusa", help="train Medusa heads for a target on CPU", allow_abbrev=False)
    medusa.add_argument("--target", default=None, help="model ref (default: the embedded SmolLM2)")
    medusa.add_argument("--out", default=None, help="checkpoint folder (default: the shipped heads' folder)")
    medusa.add_argument("--heads", type=int, default=3, help="heads to train: tokens drafted per step (default 3)")
    medusa.add_argument("--minutes", type=float, default=3.0, help="training time budget")
    medusa.add_argument("--max-chars", type=int, default=120_000, help="standard-library text to use")
    medusa.add_argument("--chat-samples", type=int, default=10, help="greedy chat answers to self-distil from")
    eagle = commands.add_parser(
        "train-eagle3", help="train an EAGLE-3 head for a target by self-distillation", allow_abbrev=False
    )
    eagle.add_argument("--target", default=None, help="model ref (default: the embedded SmolLM2)")
    eagle.add_argument("--out", default=None, help="head folder (default: the shipped head's folder)")
    for name, field in Eagle3Training.__dataclass_fields__.items():
        flag = "--" + name.replace("_", "-")
        kind = {"float": float, "str": str, "str | None": str}.get(field.type, int)
        eagle.add_argument(
            flag, type=kind, default=field.default, help=f"{field.metadata['help']} (default {field.default})"
        )
    calib = commands.add_parser("calibrate-self", help="choose the layers the self drafter keeps", allow_abbrev=False)
    calib.add_argument("--target", default=None, help="model ref (default: the embedded SmolLM2)")
    calib.add_argument("--keep", type=int, default=None, help="layers to keep (default: half)")
    calib.add_argument("--max-chars", type=int, default=20_000, help="calibration text to use (default 20000)")
    calib.add_argument("--out", default=None, help="where to write (default: engine/calibration/<model>.json)")
    return parser


def _offline_engine(target: str | None):
    """The target alone on CPU, for the offline preparation commands."""
    from engine.config import EngineConfig
    from engine.factory import load_engine

    return load_engine(EngineConfig(target=target, drafter="none", device="cpu", max_model_len=2048))


def train_medusa_command(args: dict) -> None:
    from pathlib import Path

    from engine.drafters.medusa import shipped_heads
    from engine.training.calibration import train_medusa

    loaded = _offline_engine(args["target"])
    out = Path(args["out"]) if args["out"] else shipped_heads(loaded.model_name)
    report = train_medusa(
        loaded.engine,
        loaded.tokenizer,
        loaded.model_name,
        out,
        args["heads"],
        args["minutes"],
        args["max_chars"],
        args["chat_samples"],
    )
    print(json.dumps({"out": str(out), **report}, indent=2))


def train_eagle3_command(args: dict) -> None:
    from pathlib import Path

    from engine.training.eagle3 import train_eagle3

    settings = Eagle3Training(**{name: args[name] for name in Eagle3Training.__dataclass_fields__})
    out = Path(args["out"]) if args["out"] else None
    print(json.dumps(train_eagle3(args["target"], out, settings), indent=2))


def calibrate_self_command(args: dict) -> None:
    from pathlib import Path

    from engine.training.calibration import calibrate_self

    loaded = _offline_engine(args["target"])
    keep = args["keep"] or len(loaded.engine.target.layers) // 2
    out = Path(args["out"]) if args["out"] else None
    print(
        json.dumps(
            calibrate_self(loaded.engine, loaded.tokenizer, loaded.model_name, keep, args["max_chars"], out), indent=2
        )
    )


def chat_command(args: dict) -> None:
    from .chat_client import chat

    try:
        code = chat(
            args["url"], args["api_key"], args["system"], args["temperature"], args["max_tokens"], args["drafter"]
        )
    except KeyboardInterrupt:  # before the first prompt (connecting): leave quietly, as a shell does
        print(file=sys.stderr)
        code = 130
    raise SystemExit(code)


def check_port(host: str, port: int) -> list[str]:
    """Whether the server can listen on ``host:port``: found out before minutes of loading."""
    if port == 0:
        return []
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            return [f"port {port} on {host} {why}; choose another with --port"]
    return []


def serve(settings: ServeSettings, config_file: str | None = None) -> None:
    from server.tenants import Tenancy

    tenancy = Tenancy.from_settings(settings.api_key, settings.api_key_file, settings.share_cache, settings.host)
    config = settings.engine_config(shares=tenancy.share)
    # A busy port is refused before torch loads (this module's imports load none): in a moment,
    # not after the tens of seconds torch takes on a loaded host.
    if problems := check_port(settings.host, settings.port):
        raise ConfigError("\n".join(problems))

    from engine.preflight import preflight

    # before any weights load, and before the server's imports: a line each
    problems = preflight(config)
    if problems:
        if config_file is not None and settings.needs:
            problems.append(f"{config_file} needs {settings.needs}")
        raise ConfigError("\n".join(problems))

    import uvicorn

    from engine.factory import load_engine

    from .app import create_app
    from .shutdown import SETTLE_SECONDS, GracefulServer

    # What the imports made lives as long as the process (200k objects): frozen, it is left out of
    # the full collections start-up makes after each stage (engine/cpu/memory.py), which then walk
    # only what loading made (0.5 s of an 8.7 s start here). vLLM freezes its heap once warmed up.
    gc.collect()
    gc.freeze()
    app = create_app(lambda: load_engine(config), settings)
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            log_config=None,  # uvicorn logs through our handler (text or JSON)
            timeout_graceful_shutdown=SETTLE_SECONDS,  # the drain has ended every request by then
        ),
        settings.shutdown_timeout,
    )
    server.run()
    gc.unfreeze()  # collectable at exit again: a native module's leak check would otherwise count them
    if app.state.exit_code:
        raise SystemExit(app.state.exit_code)


def parse(argv: list[str] | None = None) -> dict:
    """The command's arguments. An unknown flag is reported with the usage of the command it was
    given to (argparse's own message shows the top-level usage)."""
    parser = _parser()
    known, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        command = commands.choices[known.command]
        flags = [option for action in command._actions for option in action.option_strings]
        typed = unknown[0].split("=")[0]
        # an abbreviation names the flag it starts; a typo, the closest one
        guesses = sorted((f for f in flags if f.startswith(typed)), key=len) or difflib.get_close_matches(
            typed, flags, n=1
        )
        hint = f" (did you mean {guesses[0]}?)" if guesses else ""
        print(f"usage: {command.prog} [options]; {command.prog} --help lists them", file=sys.stderr)
        print(f"{command.prog}: error: unrecognized arguments: {' '.join(unknown)}{hint}", file=sys.stderr)
        raise SystemExit(2)
    return vars(known)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    command, config_file = args.pop("command"), args.pop("config", None)
    try:
        if command != "serve":
            # The terminal chat prints only the conversation; the offline tools report their progress.
            level = "WARNING" if command == "chat" else "INFO"
            logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            commands = {
                "train-medusa": train_medusa_command,
                "train-eagle3": train_eagle3_command,
                "calibrate-self": calibrate_self_command,
                "chat": chat_command,
            }
            commands[command](args)
            return
        config_file = config_file or os.environ.get("SPECSERVE_CONFIG")
        settings = ServeSettings.load(config_file, args)
        configure_logging(settings.log_level, settings.log_format)
        serve(settings, config_file)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"specserve: {line}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
