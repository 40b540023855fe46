"""The trainer's Prometheus gauges: served by rank 0 while a round trains, scraped here from inside
the step callback (mid-round), gone once the round is trained; a taken port does not stop training."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prodrl_pipelines.loop import train
from tests.test_distributed import _round_with_data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gauges(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels} | {
        f"{s.name}{{round={s.labels['round']}}}": s.value for f in text_string_to_metric_families(text)
        for s in f.samples if "round" in s.labels}


def test_rank_0_serves_step_loss_throughput_mismatch_and_last_step_time_while_a_round_trains(tmp_path, pg_instance,
                                                                                          caplog):
    port = _free_port()
    res, svc, key = _round_with_data(tmp_path, pg_instance, train_processes=1, steps_per_round=3, batch_size=2,
                                     observability_trainer_metrics_port=port)
    seen: list[tuple[int, dict, dict, float]] = []

    def scrape(step: int, metrics: dict) -> None:  # runs after the exporter took the step
        seen.append((step, metrics, _gauges(port), time.time()))

    t0 = time.time()
    out = train.train(svc, key, on_step=scrape, progress=False, out_dir=tmp_path / "out")
    taken = [x for x in seen if not x[1].get("skipped")]
    assert len(taken) == out["steps_taken"] >= 2
    for n, (step, metrics, g, at) in enumerate(taken, start=1):
        assert g["prodrl_trainer_round_step"] == n and g["prodrl_trainer_step"] == step
        assert g["prodrl_trainer_loss"] == pytest.approx(metrics["loss"])
        assert g["prodrl_trainer_tokens_per_second"] == pytest.approx(metrics["tokens_per_s"])
        assert g["prodrl_trainer_engine_mismatch"] == pytest.approx(metrics["engine_mismatch"])
        assert t0 <= g["prodrl_trainer_last_step_timestamp_seconds"] <= at
        assert g[f"prodrl_trainer_info{{round={key}}}"] == 1
    with pytest.raises(httpx.ConnectError):  # the round is trained: nothing serves it any more
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)

    # the port taken (another round's trainer on this host): training goes on without its metrics
    with socket.socket() as taken_port:
        taken_port.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrapes' closed connections linger
        taken_port.bind(("127.0.0.1", port))
        taken_port.listen()
        again = train.train(svc, key, progress=False, out_dir=tmp_path / "again")
    assert again["steps_taken"] == out["steps_taken"]
    assert f"trainer metrics not served on 127.0.0.1:{port}" in caplog.text


def test_the_final_values_wait_for_a_scrape_before_the_exporter_closes():
    import threading

    from prodrl_pipelines.observability.trainer_metrics import TrainerMetrics

    port = _free_port()
    tm = TrainerMetrics("round-000003").start("127.0.0.1", port)
    tm.on_step(41, {"loss": 0.5, "tokens_per_s": 100.0})
    closing = threading.Thread(target=tm.close, kwargs={"final_scrape_s": 300})
    closing.start()
    closing.join(0.5)
    assert closing.is_alive()  # nothing scraped since the last step: it waits (up to 300 s)
    g = _gauges(port)
    closing.join(60)
    assert not closing.is_alive() and g["prodrl_trainer_step"] == 41 and g["prodrl_trainer_loss"] == 0.5
    t = TrainerMetrics("round-000004").start("127.0.0.1", port)  # no wait asked: closes at once
    t.close(final_scrape_s=0)
