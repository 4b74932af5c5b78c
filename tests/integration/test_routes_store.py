"""Alias weights in a real Valkey (llmserve/catalog/routes.py): `up` seeds over a later route, a gateway
seeds only what is missing, `route` validates; two versions of one GGUF share one tokenizer."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from llmserve.catalog import routes
from llmserve.catalog.models_file import ModelsFileError, parse_models
from tokenizer_svc.service import load_models

V1, V2 = "smollm2-135m@v1", "smollm2-135m@v2"
CONFIG = parse_models(f"""
models: [{{id: {V1}, path: smollm2-135m}}, {{id: {V2}, path: smollm2-135m}}]
aliases: {{smollm2-135m: {{{V1}: 95, {V2}: 5}}}}
""")


def test_route_sets_validated_weights_and_up_seeds_over_them(clean_redis):
    routes.seed(clean_redis, CONFIG, overwrite=True)
    assert routes.get_weights(clean_redis, "smollm2-135m") == {V1: 95, V2: 5}
    assert routes.set_weights(clean_redis, "smollm2-135m", {V1: 100}) == {V1: 100}
    for alias, weights, why in (("smollm2-135m", {V1: 0}, "all zero"), ("smollm2-135m", {"x@v1": 1}, "unknown model"),
                                ("smollm2-135m", {V1: -1}, "non-negative"), ("nope", {V1: 1}, "unknown alias")):
        with pytest.raises(ModelsFileError, match=why):
            routes.set_weights(clean_redis, alias, weights)
    assert routes.get_weights(clean_redis, "smollm2-135m") == {V1: 100}
    routes.seed(clean_redis, CONFIG, overwrite=True)                # the next `up` starts from its file
    assert routes.get_weights(clean_redis, "smollm2-135m") == {V1: 95, V2: 5}


async def test_a_gateway_start_never_undoes_a_route(clean_redis, redis_url):
    routes.seed(clean_redis, CONFIG, overwrite=True)
    routes.set_weights(clean_redis, "smollm2-135m", {V1: 100})
    client = aioredis.Redis.from_url(redis_url)
    try:
        await routes.seed_async(client, CONFIG)
        assert await routes.read_weights(client, ["smollm2-135m"]) == {"smollm2-135m": {V1: 100}}
    finally:
        await client.aclose()


def test_two_versions_of_one_file_load_one_tokenizer(smollm2_path):
    models = load_models([f"{V1}=smollm2-135m", f"{V2}={smollm2_path}"])
    assert list(models) == [V1, V2] and models[V1] is models[V2]
