"""Tenants file parsing and API-key authentication."""

import pytest

from llmserve.errors import Unauthenticated
from llmserve.v1 import inference_pb2 as pb

from gateway.tenants import TenantRegistry, TenantsError, hash_key, parse_tenants

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
])
def test_bad_files_rejected(bad):
    with pytest.raises(TenantsError):
        parse_tenants(bad)


def test_dev_tenants_file_has_dev_key():
    from pathlib import Path
    reg = TenantRegistry(Path(__file__).parents[2] / "deploy" / "tenants.dev.yaml").load()
    assert reg.authenticate({"authorization": "Bearer dev-key"}).id == "dev"
