"""Latency targets: deadlines, met/missed, and the tenants file's SLO fields (the TTFT estimate: test_slo_estimate.py)."""

from __future__ import annotations

import math

import pytest

from gateway.tenants import TenantsError, parse_tenant
from llmserve.protocol.slo import NO_DEADLINE, Targets, item_deadline_ms, mean_tpot_ms, next_token_deadline_ms
from llmserve.v1 import queue_pb2

TENANT = {"id": "t", "requests_per_second": 1, "burst": 1, "tokens_per_minute": 100, "max_concurrent": 1,
          "max_new_tokens": 8}


def test_next_token_deadline_adds_one_tpot_per_token_generated():
    assert next_token_deadline_ms(1_000, Targets(500, 20), 0) == 1_500
    assert next_token_deadline_ms(1_000, Targets(500, 20), 10) == 1_700
    assert next_token_deadline_ms(1_000, Targets(0, 20), 10) == NO_DEADLINE      # no TTFT target
    item = queue_pb2.WorkItem(arrival_unix_ms=1_000, slo_ttft_ms=500, slo_tpot_ms=20, generated_token_ids=[1, 2])
    assert item_deadline_ms(item) == 1_540


def test_met_checks_only_the_targets_a_request_has():
    assert Targets(100, 10).met(100, 10) and not Targets(100, 10).met(101, 1) and not Targets(100, 10).met(1, 11)
    assert Targets(0, 10).met(10_000, 10) and Targets().met(math.inf, math.inf)
    assert mean_tpot_ms(ttft_ms=100, total_ms=400, completion_tokens=4) == 100
    assert mean_tpot_ms(ttft_ms=100, total_ms=400, completion_tokens=1) == 0


def test_tenant_slo_defaults_and_shed_flag_parse_and_are_checked():
    tenant = parse_tenant({**TENANT, "slo_ttft_ms": 800, "slo_tpot_ms": 50, "shed_unmeetable": True})
    assert tenant.slo == Targets(800, 50) and tenant.shed_unmeetable
    assert parse_tenant(TENANT).slo == Targets() and not parse_tenant(TENANT).shed_unmeetable
    for bad in ({"slo_ttft_ms": -1}, {"slo_tpot_ms": 1.5}, {"slo_ttft_ms": 3_600_001}, {"shed_unmeetable": "yes"}):
        with pytest.raises(TenantsError, match=next(iter(bad))):
            parse_tenant({**TENANT, **bad})
