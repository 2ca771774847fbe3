"""``specserve`` with the fault hook installed (tests/faults.py): ``python -m tests.fault_server serve ...``.

It wraps start-up's ``load_engine`` so that the loaded engine reads fault markers from prompts,
then runs the real command line."""

from __future__ import annotations

import engine.factory
from server import cli
from tests.faults import prompt_faults

_load_engine = engine.factory.load_engine


def _load_with_faults(config, show_progress=None):
    loaded = _load_engine(config, show_progress)
    prompt_faults(loaded.engine, loaded.tokenizer.decode)
    return loaded


if __name__ == "__main__":
    engine.factory.load_engine = _load_with_faults
    cli.main()
