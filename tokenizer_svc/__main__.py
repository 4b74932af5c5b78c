"""`python -m tokenizer_svc`: the tokenizer pool service (llmserve.v1.Tokenizer)."""

from __future__ import annotations

import asyncio
import sys

import structlog

from llmserve.runtime.log import configure_logging
from llmserve.runtime.server import serve
from tokenizer_svc.config import TokenizerSettings
from tokenizer_svc.service import TokenizerService, load_models

logger = structlog.get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    settings = TokenizerSettings.load_or_exit(sys.argv[1:] if argv is None else argv, prog="python -m tokenizer_svc",
                                              description="llmserve tokenizer pool: encode, chat templates, decode")
    configure_logging("tokenizer_svc", settings.log_level)
    try:
        models = load_models(settings.model_specs())  # before serving: a bad model is a clean start-up error
    except (OSError, ValueError) as exc:  # missing file, unreadable GGUF, UnsupportedTokenizer, ...
        logger.error("cannot load model", error=str(exc))
        return 2

    async def run() -> int:
        stop = asyncio.Event()
        return await serve(TokenizerService(settings, models, stop), settings, "tokenizer_svc",
                           max_message_bytes=settings.max_message_bytes, stop=stop)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
