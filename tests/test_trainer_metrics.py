"""The trainer's Prometheus exporter on its own (a round's rank 0 serving it while it trains is
tested in test_distributed): the final values wait for a scrape before it closes, and a port another
trainer holds does not stop training."""

from __future__ import annotations

import logging
import threading

import httpx

from prodrl_pipelines.deploy_targets.processes import pick_port
from prodrl_pipelines.observability.trainer_metrics import TrainerMetrics
from tests.test_distributed import trainer_gauges


def test_the_final_values_wait_for_a_scrape_before_the_exporter_closes():
    port = pick_port()
    tm = TrainerMetrics("round-000003").start("127.0.0.1", port)
    tm.on_step(41, {"loss": 0.5, "tokens_per_s": 100.0})
    closing = threading.Thread(target=tm.close, kwargs={"final_scrape_s": 300})
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # nothing scraped since the last step: it waits (up to 300 s)
    g = trainer_gauges(port)
    closing.join(60)
    assert not closing.is_alive() and g["prodrl_trainer_step"] == 41 and g["prodrl_trainer_loss"] == 0.5
    assert g["prodrl_trainer_round_step"] == 1 and g["prodrl_trainer_info{round=round-000003}"] == 1


def test_a_taken_port_is_logged_and_the_round_goes_on_without_metrics(caplog):
    port = pick_port()
    first = TrainerMetrics("round-000001").start("127.0.0.1", port)
    try:
        with caplog.at_level(logging.WARNING):
            second = TrainerMetrics("round-000002").start("127.0.0.1", port)
        assert f"trainer metrics not served on 127.0.0.1:{port}" in caplog.text
        second.on_step(1, {"loss": 1.0})  # the step callback still works
        second.close(final_scrape_s=300)  # nothing served: no wait
        assert "round-000001" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        first.close()
