"""kvcopy's vLLM spec (untiered; the tiered one: test_vllm_tiering_spec.py) through vLLM's own Prometheus
logger: vLLM's frontend declares the connector's metrics from the spec class the config names
(``KVCopyOffloadingSpec``, never built there) and asserts every metric a step reports was declared. vLLM's real
Scheduler on the CPU; the logger is vLLM's ``KVConnectorProm`` over a registry of the test's own
(tests/helpers/vllm.py, ``prometheus_logger``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")

from helpers.vllm import PROMPT, info_labels, make_rig, metric_totals, prometheus_logger

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


def test_the_untiered_specs_metrics_and_info_reach_vllms_logger(tmp_path):
    rig = make_rig(tmp_path)
    try:
        registry = prometheus_logger(rig)
        rig.store_and_reset(PROMPT)
        rig.rerun([*PROMPT, 5, 6, 7])
        totals = metric_totals(registry)
        assert totals["vllm:kv_offload_kvcopy_hits_loaded_total"] == 1
        assert totals["vllm:kv_offload_store_bytes_total"] > 0
        # the manager fills vLLM's CPU tier's info; its label names come from the spec class
        assert any(labels.get("cpu_num_chunks") for labels in info_labels(registry)), info_labels(registry)
    finally:
        rig.close()
