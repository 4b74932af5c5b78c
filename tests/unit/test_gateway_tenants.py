"""Tenants file parsing and API-key authentication."""

import pytest

from gateway.tenants import TenantRegistry, TenantsError, hash_key, parse_tenants
from llmserve.runtime.errors import Unauthenticated
from llmserve.v1 import inference_pb2 as pb

DOC = f"""
tenants:
  - id: acme
    api_keys: ["sha256:{hash_key('k1')}", "sha256:{hash_key('k2')}"]
    requests_per_second: 5
    burst: 10
    tokens_per_minute: 20000
    max_concurrent: 4
    max_new_tokens: 512
    priority: high
    models: ["smollm2-135m"]
"""


def test_parse_and_authenticate(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(DOC)
    reg = TenantRegistry(path).load()
    tenant = reg.authenticate({"authorization": "Bearer k2"})
    assert (tenant.id, tenant.burst, tenant.max_concurrent, tenant.priority) == ("acme", 10, 4, pb.PRIORITY_HIGH)
    assert tenant.may_use("smollm2-135m") and not tenant.may_use("other")
    for md in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"}, {"authorization": "Bearer "}):
        with pytest.raises(Unauthenticated):
            reg.authenticate(md)


def test_reload_swaps_table_and_keeps_it_on_error(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(DOC)
    reg = TenantRegistry(path).load()
    path.write_text(DOC.replace(hash_key("k2"), hash_key("k3")))
    assert reg.reload()
    assert reg.authenticate({"authorization": "Bearer k3"}).id == "acme"
    with pytest.raises(Unauthenticated):
        reg.authenticate({"authorization": "Bearer k2"})
    path.write_text("tenants: [{id: broken}]")
    assert not reg.reload()
    assert reg.authenticate({"authorization": "Bearer k3"}).id == "acme"


@pytest.mark.parametrize("bad", [
    DOC.replace("sha256:", "plain:"), DOC.replace("burst: 10", "burst: 0"), DOC.replace("priority: high", "priority: x"),
    DOC + DOC.split("tenants:")[1], DOC.replace("id: acme", "id: 'a{b}'"),
    DOC + "    cache_group: [a, b]\n", DOC + "    raw_special_tokens: 'yes'\n",
])
def test_bad_files_rejected(bad):
    with pytest.raises(TenantsError):
        parse_tenants(bad)


def test_dev_tenants_file_has_dev_key():
    from pathlib import Path
    reg = TenantRegistry(Path(__file__).parents[2] / "deploy" / "tenants.dev.yaml").load()
    assert reg.authenticate({"authorization": "Bearer dev-key"}).id == "dev"



def tenant_entry(tenant_id: str, cache_group: str = "") -> str:
    group = f"    cache_group: {cache_group}\n" if cache_group else ""
    return (f"  - id: {tenant_id}\n    api_keys: [\"sha256:{hash_key(tenant_id)}\"]\n    requests_per_second: 1\n"
            f"    burst: 1\n    tokens_per_minute: 100\n    max_concurrent: 1\n    max_new_tokens: 8\n{group}")


def test_cache_salt_is_per_tenant_unless_tenants_share_a_cache_group():
    doc = "tenants:\n" + "".join(tenant_entry(t, g) for t, g in
                                  (("solo", ""), ("twin", ""), ("red", "team"), ("blue", "team")))
    salts = {t.id: t.cache_salt for t in parse_tenants(doc).values()}
    assert salts == {"solo": "tenant:solo", "twin": "tenant:twin", "red": "group:team", "blue": "group:team"}
    # a group named like a tenant does not share that tenant's cache
    lookalike = {t.id: t.cache_salt for t in parse_tenants(doc.replace("team", "solo")).values()}
    assert lookalike["red"] == "group:solo" != lookalike["solo"]


def test_raw_special_tokens_is_off_unless_the_file_says_true():
    assert {t.raw_special_tokens for t in parse_tenants(DOC).values()} == {False}
    assert {t.raw_special_tokens for t in parse_tenants(DOC + "    raw_special_tokens: true\n").values()} == {True}


def test_weight_defaults_to_one_and_must_be_positive():
    assert {t.weight for t in parse_tenants(DOC).values()} == {1.0}
    assert {t.weight for t in parse_tenants(DOC + "    weight: 2.5\n").values()} == {2.5}
    for bad in ("0", "-1", "heavy"):
        with pytest.raises(TenantsError):
            parse_tenants(DOC + f"    weight: {bad}\n")
