"""`python -m tokenizer_svc`: the tokenizer pool service (llmserve.v1.Tokenizer)."""

from __future__ import annotations

import asyncio
import sys

from llmserve.log import configure_logging
from llmserve.server import serve
from llmserve.settings import SettingsError
from tokenizer_svc.config import TokenizerSettings
from tokenizer_svc.service import TokenizerService, load_models


def main(argv: list[str] | None = None) -> int:
    try:
        settings = TokenizerSettings.load(sys.argv[1:] if argv is None else argv, prog="python -m tokenizer_svc",
                                          description="llmserve tokenizer pool: encode, chat templates, decode")
    except SettingsError as exc:
        print(f"tokenizer_svc: {exc}", file=sys.stderr)
        return 2
    configure_logging("tokenizer_svc", settings.log_level)
    try:
        models = load_models(settings.model_specs())  # before serving: a bad model is a clean start-up error
    except (OSError, ValueError) as exc:  # missing file, unreadable GGUF, UnsupportedTokenizer, ...
        print(f"tokenizer_svc: cannot load model: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(TokenizerService(settings, models), settings, "tokenizer_svc",
                      max_message_bytes=settings.max_message_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
