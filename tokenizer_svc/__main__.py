"""`python -m tokenizer_svc`: the tokenizer pool service (llmserve.v1.Tokenizer)."""

from __future__ import annotations

import asyncio
import sys

from llmserve.log import configure_logging
from llmserve.server import serve
from llmserve.settings import SettingsError
from tokenizer_svc.config import TokenizerSettings
from tokenizer_svc.service import TokenizerService


def main(argv: list[str] | None = None) -> int:
    try:
        settings = TokenizerSettings.load(sys.argv[1:] if argv is None else argv, prog="python -m tokenizer_svc",
                                          description="llmserve tokenizer pool: encode, chat templates, decode")
    except SettingsError as exc:
        print(f"tokenizer_svc: {exc}", file=sys.stderr)
        return 2
    configure_logging("tokenizer_svc", settings.log_level)
    asyncio.run(serve(TokenizerService(settings), settings, "tokenizer_svc",
                      max_message_bytes=settings.max_message_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
