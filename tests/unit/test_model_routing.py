"""Models file parsing, `ID=PATH` specs, the gateway's alias routing (weights, pins, live
workers, NOT_FOUND), tenant permissions on versions, and `llmserve route`'s argument checks."""

from __future__ import annotations

import pytest

from gateway.model_router import Router
from gateway.tenants import parse_tenant
from llmserve.catalog import model_store
from llmserve.catalog.models_file import ModelsFileError, from_setting, parse_models
from llmserve.cli import parse_targets
from llmserve.protocol.seeded_pick import weighted_pick
from llmserve.runtime.errors import NotFound

V1, V2 = "smollm2-135m@v1", "smollm2-135m@v2"
FILE = f"""
models:
  - {{id: {V1}, path: smollm2-135m, workers: 1}}
  - {{id: {V2}, path: /models/v2.gguf, workers: 2}}
aliases:
  smollm2-135m: {{{V1}: 95, {V2}: 5}}
default: smollm2-135m
"""


def make_router(live=(V1, V2)) -> Router:
    router = Router(parse_models(FILE), redis=None, refresh_s=0.25, heartbeat_ttl_ms=3000)  # type: ignore[arg-type]
    router.live = {V1: int(V1 in live), V2: int(V2 in live)}
    return router


def test_models_file_parses_ids_paths_workers_aliases_and_default():
    config = parse_models(FILE)
    assert config.ids == [V1, V2] and [m.workers for m in config.models] == [1, 2]
    assert config.aliases == {"smollm2-135m": {V1: 95, V2: 5}} and config.default_name == "smollm2-135m"
    assert config.specs() == [f"{V1}=smollm2-135m", f"{V2}=/models/v2.gguf"]


@pytest.mark.parametrize("text, why", [
    ("models: []", "at least one model"),
    ("models: [{id: nover, path: x}]", "NAME@VERSION"),
    ("models: [{id: a@v1}]", "path is required"),
    ("models: [{id: a@v1, path: x}, {id: a@v1, path: y}]", "listed twice"),
    ("models: [{id: a@v1, path: x}]\naliases: {a: {a@v2: 1}}", "unknown model"),
    ("models: [{id: a@v1, path: x}]\naliases: {a: {a@v1: 0}}", "all zero"),
    ("models: [{id: a@v1, path: x}]\naliases: {a: {a@v1: -3}}", "non-negative integer"),
    ("models: [{id: a@v1, path: x}]\naliases: {a: {a@v1: 1.5}}", "non-negative integer"),
    ("models: [{id: a@v1, path: x}]\ndefault: b", "neither a model id nor an alias"),
])
def test_models_file_errors_say_what_is_wrong(text, why):
    with pytest.raises(ModelsFileError, match=why):
        parse_models(text)


def test_plain_models_setting_is_what_services_took_before():
    config = from_setting("smollm2-135m, /models/other")
    assert config.ids == ["smollm2-135m", "other"] and config.aliases == {} and config.default_name == "smollm2-135m"


def test_id_equals_path_spec_serves_the_path_under_the_id():
    assert model_store.split_spec(f"{V2}=smollm2-135m") == (V2, "smollm2-135m")
    assert model_store.model_id(f"{V2}=/models/x.gguf") == V2
    assert model_store.model_id("/models/x") == "x"


def test_weighted_pick_is_fixed_per_request_id_and_follows_the_weights():
    weights = {V1: 95, V2: 5}
    assert all(weighted_pick(weights, f"r{i}", "a") == weighted_pick(weights, f"r{i}", "a") for i in range(100))
    on_v2 = sum(weighted_pick(weights, f"r{i}", "a") == V2 for i in range(20_000))
    assert 800 < on_v2 < 1200                      # 5 % of 20 000 = 1000, sd 31
    assert {weighted_pick({V1: 100, V2: 0}, f"r{i}", "a") for i in range(500)} == {V1}


def test_alias_routes_by_weight_and_the_default_is_the_alias():
    router = make_router()
    picks = {router.route("", "", f"r{i}").model for i in range(400)}
    assert picks == {V1, V2}
    assert router.route("", "", "x").requested == "smollm2-135m"


def test_pin_selects_the_version_of_an_alias_or_an_id():
    router = make_router()
    assert router.route("smollm2-135m", "v2", "r").model == V2
    assert router.route(V1, "v2", "r").model == V2
    assert router.route("smollm2-135m", V1, "r").model == V1


def test_unknown_model_or_version_is_not_found_naming_it():
    router = make_router()
    with pytest.raises(NotFound, match="gpt-17"):
        router.route("gpt-17", "", "r")
    with pytest.raises(NotFound, match="v9"):
        router.route("smollm2-135m", "v9", "r")


def test_alias_skips_versions_without_live_workers_but_a_pin_does_not():
    router = make_router(live=(V1,))
    assert {router.route("smollm2-135m", "", f"r{i}").model for i in range(400)} == {V1}
    assert router.route("smollm2-135m", "v2", "r").model == V2   # queues; the max queue wait answers
    router.live = {V1: 0, V2: 0}                                   # nobody live: weights as they are
    assert {router.route("smollm2-135m", "", f"r{i}").model for i in range(400)} == {V1, V2}


def test_a_pin_still_reaches_a_version_routed_to_zero():
    router = make_router()
    router.weights["smollm2-135m"] = {V1: 100}
    assert {router.route("smollm2-135m", "", f"r{i}").model for i in range(200)} == {V1}
    assert router.route("smollm2-135m", "v2", "r").model == V2


def tenant(models):
    return parse_tenant({"id": "t", "requests_per_second": 1, "burst": 1, "tokens_per_minute": 1,
                         "max_concurrent": 1, "max_new_tokens": 1, "models": models})


def test_tenant_permissions_on_names_and_versions():
    by_name, only_v1 = tenant(["smollm2-135m"]), tenant([V1])
    assert by_name.may_use("smollm2-135m") and by_name.may_use(V1) and by_name.may_use(V2)
    assert only_v1.may_use(V1) and not only_v1.may_use(V2) and not only_v1.may_use("smollm2-135m")


def test_route_arguments():
    assert parse_targets([f"{V1}=90", f"{V2}=10"]) == {V1: 90, V2: 10}
    for bad in (["nothing"], [f"{V1}=x"], [f"{V1}=1", f"{V1}=2"]):
        with pytest.raises(SystemExit):
            parse_targets(bad)


def test_admin_commands_find_the_redis_up_recorded(tmp_path, monkeypatch):
    from llmserve import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(SystemExit, match="no Redis"):
        cli.admin_redis_url(None)
    cli._record_redis_url(tmp_path / ".llmserve", "redis://:pw@127.0.0.1:7000/0")
    assert (tmp_path / ".llmserve" / "redis-url").stat().st_mode & 0o077 == 0      # it may hold a password
    assert cli.admin_redis_url(None) == "redis://:pw@127.0.0.1:7000/0"
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:7001/0")
    assert cli.admin_redis_url(None) == "redis://127.0.0.1:7001/0"
    assert cli.admin_redis_url("redis://127.0.0.1:7002/0") == "redis://127.0.0.1:7002/0"
