"""``bytediet bench`` on tiny models: statistics against numpy, workloads, result shape, peers, CLI output.

No timing is asserted: only counts, shapes, identities between reported numbers, and the roofline
predictions recomputed independently.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.cli import main
from bytediet.errors import ConfigError
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.perf import measure as measure_mod
from bytediet.perf.bench import (
    BenchConfig,
    ModelWeightBits,
    RequestTiming,
    Unavailable,
    make_workload,
    percentile,
    run_bench,
    summarize,
)
from bytediet.perf.peers import BytedietSystem, TransformersSystem, make_peers
from bytediet.perf.roofline import analyze
from tests.conftest import model_from_state, random_state, tiny_config
from tests.eval.test_harness import write_tiny_checkpoint

FAKE_MACHINE = {
    "version": measure_mod.CACHE_VERSION,
    "host": "test",
    "cpu": "test CPU",
    "threads": 2,
    "torch": "x",
    "measured_at": "2026-01-01T00:00:00",
    "read_bandwidth": 10e9,
    "copy_bandwidth": 12e9,
    "peak_flops": {"fp32": 50e9},
    "memory_bytes": 16e9,
    "llc_bytes": 32e6,
}


# ----------------------------------------------------------------------------------- statistics
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-9, abs=1e-6)


def test_percentile_rejects_bad_input():
    with pytest.raises(ConfigError, match="empty"):
        percentile([], 50)
    with pytest.raises(ConfigError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 500), st.integers(1, 200), st.floats(1e-3, 10), st.floats(0, 10)),
        min_size=1,
        max_size=40,
    )
)
def test_summary_against_numpy(rows):
    timings = [RequestTiming(p, n, ttft, ttft + extra) for p, n, ttft, extra in rows]
    s = summarize(timings)
    ttft = np.array([t.ttft_s for t in timings])
    tpot = np.array([(t.finish_s - t.ttft_s) / (t.output_tokens - 1) for t in timings if t.output_tokens > 1])
    finish = max(t.finish_s for t in timings)
    assert s["requests"] == len(rows) and s["output_tokens"] == sum(r[1] for r in rows)
    assert s["output_tokens_per_s"] == pytest.approx(sum(r[1] for r in rows) / finish)
    assert s["ttft_p50_s"] == pytest.approx(np.percentile(ttft, 50))
    assert s["ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99))
    if len(tpot):
        assert s["tpot_p50_s"] == pytest.approx(np.percentile(tpot, 50))
        assert s["tpot_p99_s"] == pytest.approx(np.percentile(tpot, 99))
        assert s["tpot_mean_s"] == pytest.approx(tpot.mean())
    else:  # every request produced one token: no time per output token exists
        assert s["tpot_p50_s"] is None and s["tpot_mean_s"] is None


def test_workload_is_seeded_and_cut_from_the_corpus():
    corpus = list(range(1000, 3000))
    a = make_workload(corpus, 20, (5, 40), (2, 9), seed=3)
    assert a == make_workload(corpus, 20, (5, 40), (2, 9), seed=3)
    assert a != make_workload(corpus, 20, (5, 40), (2, 9), seed=4)
    for prompt, n in zip(a.prompts, a.max_tokens):
        assert 5 <= len(prompt) <= 40 and 2 <= n <= 9
        start = prompt[0] - 1000
        assert list(prompt) == corpus[start : start + len(prompt)]  # a contiguous slice
    with pytest.raises(ConfigError, match="corpus has 30 tokens"):
        make_workload(list(range(30)), 2, (5, 40), (1, 2), seed=0)


def test_config_validation():
    with pytest.raises(ConfigError, match="decode_new_tokens"):
        BenchConfig(decode_new_tokens=1)
    with pytest.raises(ConfigError, match="concurrency"):
        BenchConfig(concurrency=(1, 0))
    with pytest.raises(ConfigError, match="prompt_len_range"):
        BenchConfig(prompt_len_range=(10, 5))


# ----------------------------------------------------------------------------------- the run
class BrokenPeer:
    """A peer that loads but fails while serving: the run reports it and goes on."""

    name = "broken"
    closed = False

    def info(self) -> dict:
        return {"system": "broken"}

    def serve(self, prompts, max_tokens, concurrency):
        raise RuntimeError("out of cheese")

    def close(self) -> None:
        BrokenPeer.closed = True


@pytest.fixture(scope="module")
def tiny_result():
    config = tiny_config("llama")
    model = model_from_state(config, random_state(config, seed=1))
    ours = BytedietSystem((model, None), threads=1)
    hw = measure_mod.spec_from_measurement(FAKE_MACHINE)
    cfg = BenchConfig.quick(threads=1)
    peers = [Unavailable("llama.cpp", "No module named 'llama_cpp'"), BrokenPeer()]
    snapshots = []
    result = run_bench(ours, peers, cfg, hardware=hw, checkpoint=lambda r: snapshots.append(json.dumps(r)))
    result["snapshots"] = [json.loads(s) for s in snapshots]
    return result, ours, hw, cfg


def test_result_shape_and_counts(tiny_result):
    r, ours, _, cfg = tiny_result
    json.loads(json.dumps(r))  # JSON-able
    assert set(r) >= {"machine", "config", "corpus", "systems", "ratios", "roofline", "read_bandwidth_gb_per_s"}
    assert r["machine"]["cores"] >= 1 and len(r["machine"]["load_average"]) == 3
    assert r["corpus"] == "random token ids" and r["read_bandwidth_gb_per_s"] == pytest.approx(10.0)
    mine = r["systems"]["bytediet"]
    assert mine["available"] and mine["info"]["weight_bytes"] == ours.model.weight_bytes()
    single = mine["single"]
    assert single["decode_tokens"] == cfg.decode_new_tokens  # ignore_eos: every requested token is produced
    assert single["prefill_tokens_per_s"] == pytest.approx(cfg.prefill_len / single["prefill_ttft_s"])
    assert single["achieved_weight_gb_per_s"] == pytest.approx(
        ours.model.weight_bytes() * single["decode_tokens_per_s"] / 1e9
    )
    assert set(mine["concurrency"]) == {str(c) for c in cfg.concurrency}
    for level, s in mine["concurrency"].items():
        assert s["requests"] == max(int(level), cfg.min_requests)
        assert cfg.output_len_range[0] * s["requests"] <= s["output_tokens"] <= cfg.output_len_range[1] * s["requests"]
        assert s["ttft_p50_s"] <= s["ttft_p99_s"] <= s["duration_s"]


def test_same_workload_for_every_level_and_system(tiny_result):
    """The reported token totals are exactly those of the seeded workload of each level."""
    r, ours, _, cfg = tiny_result
    from bytediet.eval.corpus import corpus_token_ids

    ids, _ = corpus_token_ids(None, ours.model.config.vocab_size, cfg.max_sequence_len, cfg.seed)
    for level in cfg.concurrency:
        work = make_workload(
            ids, max(level, cfg.min_requests), cfg.prompt_len_range, cfg.output_len_range, seed=cfg.seed + level
        )
        s = r["systems"]["bytediet"]["concurrency"][str(level)]
        assert s["prompt_tokens"] == sum(len(p) for p in work.prompts)
        assert s["output_tokens"] == sum(work.max_tokens)


def test_partial_results_are_handed_out_after_each_system(tiny_result):
    snaps = tiny_result[0]["snapshots"]
    assert [list(s["systems"]) for s in snaps] == [
        ["bytediet"],
        ["bytediet", "llama.cpp"],
        ["bytediet", "llama.cpp", "broken"],
    ]
    assert "roofline" in snaps[0]


def test_unavailable_and_failing_peers_are_reported(tiny_result):
    r = tiny_result[0]
    assert r["systems"]["llama.cpp"] == {"available": False, "reason": "unavailable: No module named 'llama_cpp'"}
    assert r["systems"]["broken"]["available"] is False
    assert r["systems"]["broken"]["reason"] == "failed: RuntimeError: out of cheese"
    assert BrokenPeer.closed and r["ratios"] == {}


def test_roofline_rows_are_the_analyzer_on_the_same_config(tiny_result):
    r, ours, hw, cfg = tiny_result
    rows = r["roofline"]["rows"]
    assert [row["batch"] for row in rows] == [1, *cfg.roofline_batches]
    mc = ours.model.config
    for row in rows:  # an fp32 model: 32 bits per weight everywhere; fp32 KV: 32 bits per coordinate
        if row["measurement"] == "single stream":
            pred = analyze(
                mc,
                hw,
                weights=32.0,
                kv=32.0,
                batch=1,
                prompt_len=cfg.decode_prompt_len,
                context=cfg.decode_prompt_len + cfg.decode_new_tokens // 2,
            )
            assert row["measured_tokens_per_s"] == r["systems"]["bytediet"]["single"]["decode_tokens_per_s"]
        else:
            pred = analyze(
                mc,
                hw,
                weights=32.0,
                kv=32.0,
                batch=row["batch"],
                prompt_len=cfg.roofline_prompt_len,
                context=cfg.roofline_prompt_len + 1 + cfg.roofline_steps // 2,
            )
            assert row["forward_s_per_step"] + row["overhead_s_per_step"] == pytest.approx(row["measured_step_s"])
            assert row["linear_pass_s"] > 0
        assert row["predicted_tokens_per_s"] == pytest.approx(pred.decode_tokens_per_s)
        assert row["measured_over_predicted"] == pytest.approx(row["measured_tokens_per_s"] / pred.decode_tokens_per_s)


def test_model_weight_bits_follow_each_layers_format():
    from bytediet.models.quantize import QuantizeConfig, quantize

    config = tiny_config("llama")
    model = model_from_state(config, random_state(config))
    quantize(model, QuantizeConfig(format="int8", overrides={"lm_head": "fp32"}))
    bits = ModelWeightBits(model)
    h, v = config.hidden_size, config.vocab_size
    assert bits.bits_per_weight(config.intermediate_size, h) == pytest.approx(8 + 32 / h)  # int8: + fp32 scale/row
    assert bits.bits_per_weight(v, h) == 32.0  # the lm_head override
    fused_qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    assert bits.bits_per_weight(fused_qkv, h) == pytest.approx(8 + 32 / h)  # a shape the model lacks


# ----------------------------------------------------------------------------------- peers
def test_peers_that_cannot_run_are_unavailable(tmp_path):
    peers = make_peers(["llama.cpp", "transformers"], tmp_path / "nothing", threads=1, n_ctx=256, pad_token_id=0)
    assert [type(p) for p in peers] == [Unavailable, Unavailable]
    assert "GGUF" in peers[0].reason and "config.json" in peers[1].reason
    with pytest.raises(ConfigError, match="unknown peer 'vllm'"):
        make_peers(["vllm"], None, threads=1, n_ctx=256, pad_token_id=0)


def test_transformers_peer_serves_waves_with_exact_token_counts():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    peer = TransformersSystem(transformers.LlamaForCausalLM(cfg), threads=1, pad_token_id=0)
    prompts, outs = [[5, 6, 7], [8] * 9, [9, 10], [11] * 4, [12]], [3, 5, 1, 4, 2]
    timings = peer.serve(prompts, outs, concurrency=2)  # waves of 2, 2 and 1 requests
    assert [t.output_tokens for t in timings] == outs and [t.prompt_tokens for t in timings] == [3, 9, 2, 4, 1]
    for t in timings:
        assert 0 < t.ttft_s <= t.finish_s
    assert timings[0].finish_s <= timings[1].finish_s < timings[2].ttft_s  # wave 2 starts after wave 1 ends
    assert timings[2].ttft_s == timings[3].ttft_s  # one wave: one first step
    assert peer.info()["weight_bytes"] == sum(p.numel() * 4 for p in peer.model.parameters())


# ----------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-bench"), seed=2)


def test_context_part_ends_each_run_at_its_context(tiny_result):
    r, ours, hw, cfg = tiny_result
    ctx = r["systems"]["bytediet"]["context"]
    assert list(ctx) == [str(n) for n in cfg.contexts]
    for n, m in ctx.items():
        assert m["prompt_tokens"] == int(n) - cfg.context_new_tokens and m["decode_tokens"] == cfg.context_new_tokens
        assert m["decode_tokens_per_s"] == pytest.approx(1 / m["decode_step_s"])
    rows = r["context_roofline"]
    assert [row["context"] for row in rows] == list(cfg.contexts)
    for row in rows:  # the analyzer at the decode run's mean context, fp32 weights and KV
        pred = analyze(
            ours.model.config,
            hw,
            weights=32.0,
            kv=32.0,
            batch=1,
            prompt_len=row["context"],
            context=row["context"] - cfg.context_new_tokens // 2,
        )
        assert row["predicted_step_s"] == pytest.approx(pred.decode.time)
        assert row["kv_bytes_per_step"] == pytest.approx(pred.kv_bytes)
        assert row["measured_step_s"] == ctx[str(row["context"])]["decode_step_s"]


def test_variants_run_the_single_and_context_parts_against_the_same_peers():
    config = tiny_config("llama")
    state = random_state(config, seed=2)
    ours = BytedietSystem((model_from_state(config, state), None), threads=1)
    int8_model = model_from_state(config, state)
    quantize(int8_model, QuantizeConfig(format="int8"))
    variant = BytedietSystem((int8_model, None), threads=1)
    variant.name = "bytediet int8"
    peer = BytedietSystem((model_from_state(config, state), None), threads=1)
    peer.name = "peer"
    cfg = BenchConfig.quick(threads=1, concurrency=(1,))
    r = run_bench(ours, [peer], cfg, parts=["single", "concurrency", "context"], variants=[variant])
    v = r["systems"]["bytediet int8"]
    assert set(v) == {"available", "info", "single", "context"}  # no concurrency sweep for variants
    assert "int8" in v["info"]["weights"].split(",")
    assert r["ratios"]["peer"]["bytediet int8"]["decode_tokens_per_s"] == pytest.approx(
        v["single"]["decode_tokens_per_s"] / r["systems"]["peer"]["single"]["decode_tokens_per_s"]
    )
    assert set(r["ratios"]["peer"]["bytediet int8"]) >= {f"context_{n}" for n in cfg.contexts}


ALONE = ("--threads", "1", "--peers", "none")  # one thread, no peer systems


def bench(ckpt, *flags: str) -> int:
    """``bytediet bench --model CKPT --quick FLAGS`` through the CLI: its exit status."""
    return main(["bench", "--model", str(ckpt), "--quick", *flags])


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """This machine's measured ceilings come from a fixed cache file (no 5-second probe in tests)."""
    monkeypatch.setenv("BYTEDIET_CACHE", str(tmp_path / "cache"))
    path = measure_mod.cache_path(1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(FAKE_MACHINE))


def test_cli_json_prints_one_object_with_the_transformers_peer(ckpt, fake_machine, capsys, tmp_path):
    pytest.importorskip("transformers")
    out_file = tmp_path / "r.json"
    assert (
        bench(
            ckpt,
            "--threads",
            "1",
            "--peers",
            "llama.cpp,transformers",
            "--prompt-lens",
            "8,16",
            "--output-lens",
            "2,3",
            "--requests-per-level",
            "3",
            "--json",
            "--out",
            str(out_file),
            "--plot",
            str(tmp_path / "concurrency.png"),
        )
        == 0
    )
    out = capsys.readouterr().out
    obj = json.loads(out)
    assert out.strip().count("\n") == 0
    assert (tmp_path / "concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and obj["plot"].endswith(".png")
    assert obj == json.loads(out_file.read_text())
    assert obj["systems"]["llama.cpp"]["available"] is False
    assert "GGUF" in obj["systems"]["llama.cpp"]["reason"]
    hf = obj["systems"]["transformers"]
    assert hf["available"], hf.get("reason")
    ours = obj["systems"]["bytediet"]
    assert obj["config"]["prompt_len_range"] == [8, 16] and obj["config"]["output_len_range"] == [2, 3]
    assert ours["concurrency"]["1"]["requests"] == 3 and ours["concurrency"]["4"]["requests"] == 4
    for level in ("1", "4"):  # the same workload through both systems
        assert hf["concurrency"][level]["output_tokens"] == ours["concurrency"][level]["output_tokens"]
        assert hf["concurrency"][level]["prompt_tokens"] == ours["concurrency"][level]["prompt_tokens"]
    ratio = obj["ratios"]["transformers"]
    assert ratio["decode_tokens_per_s"] == pytest.approx(
        ours["single"]["decode_tokens_per_s"] / hf["single"]["decode_tokens_per_s"]
    )
    assert obj["corpus"] == "Austen, Pride and Prejudice" and obj["command"].startswith("bytediet bench --model")


def test_cli_table_and_bad_flags(ckpt, fake_machine, capsys):
    assert bench(ckpt, *ALONE, "--weights", "int8", "--parts", "single,roofline", "--roofline-batches", "2") == 0
    out = capsys.readouterr().out
    assert "single stream" in out and "predicted vs measured" in out and "int8" in out
    assert "concurrency sweep" not in out
    assert (
        bench(ckpt, *ALONE, "--formats", "int8,int8:int8", "--parts", "single,context", "--contexts", "20,30", "--json")
        == 0
    )
    obj = json.loads(capsys.readouterr().out)
    assert obj["systems"]["bytediet int8:int8"]["info"]["kv_cache_dtype"].startswith("int8")
    assert not obj["systems"]["bytediet int8"]["info"]["kv_cache_dtype"].startswith("int8")
    assert bench(ckpt, *ALONE, "--formats", "int8", "--parts", "single,context", "--contexts", "20,30") == 0
    out = capsys.readouterr().out
    assert "bytes down" in out and "bytediet int8" in out and "context scaling" in out
    assert (
        bench(ckpt, *ALONE, "--parts", "roofline", "--roofline-batches", "2", "--roofline-context", "12", "--json") == 0
    )
    obj = json.loads(capsys.readouterr().out)  # the batch's decode steps run after 12-token prompts
    assert obj["config"]["roofline_prompt_len"] == 12 and "--roofline-context 12" in obj["command"]
    assert [row["context"] for row in obj["roofline"]["rows"]] == [12 + 1 + 3 // 2]
    assert bench(ckpt, "--roofline-context", "0") == 2
    assert bench(ckpt, "--formats", "int8:zip9") == 2
    assert "zip9" in capsys.readouterr().err
    assert bench(ckpt, "--formats", "int9") == 2
    assert "int9" in capsys.readouterr().err
    assert bench(ckpt, "--concurrency", "1,x") == 2
    assert "--concurrency" in capsys.readouterr().err
    assert bench(ckpt, "--threads", "1", "--parts", "everything") == 2
    assert bench(ckpt, "--output-lens", "3") == 2
    assert "LO,HI" in capsys.readouterr().err


def test_cli_plans_a_kv_budget_before_it_runs(ckpt, fake_machine, capsys):
    """``--formats gguf:auto:<bits>`` (or ``--kv-cache-dtype auto:<bits>``): the budget is planned on calibration
    windows, as generate and serve plan it, and the plan runs (its table in the system's info)."""
    assert bench(ckpt, *ALONE, "--formats", "int8:auto:6", "--parts", "context", "--contexts", "20", "--json") == 0
    info = json.loads(capsys.readouterr().out)["systems"]["bytediet int8:auto:6"]["info"]
    assert info["kv_cache_dtype"].startswith("auto:6 [") and "k=" in info["kv_cache_dtype"]


@pytest.mark.slow
def test_cli_default_model_quick(capsys):
    assert main(["bench", "--quick", "--peers", "none", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["systems"]["bytediet"]["info"]["weights"] == "fp32"
    assert obj["roofline"]["rows"][0]["predicted_tokens_per_s"] > 0


def test_decode_steps_count_every_token_after_a_chunked_prefill():
    """Requests prefilled early keep decoding while the rest prefill; the timed steps still hold the whole
    batch, and every block is free afterwards."""
    config = tiny_config("llama")
    ours = BytedietSystem((model_from_state(config, random_state(config)), None), threads=1, max_num_batched_tokens=32)
    prompts = make_workload(list(range(90)) * 4, 8, (16, 16), (1, 1), seed=0).prompts  # 128 prompt tokens: 4+ steps
    m = ours.decode_steps(prompts, steps=5)
    assert m["batch"] == 8 and m["steps"] == 5 and m["tokens_per_s"] > 0
    engine = ours.engine(8, [1]).engine
    assert engine.num_free_blocks == engine.block_manager.num_blocks and not engine.has_unfinished_requests()


# ----------------------------------------------------------------------------------- tensor parallel
@pytest.fixture
def fake_machine_2(fake_machine):
    """The fixed ceilings at --threads 2 too (the tensor-parallel runs' two ranks of one thread each)."""
    measure_mod.cache_path(2).write_text(json.dumps(FAKE_MACHINE))


def tp_ranks_alive() -> list:
    """Spawned tensor-parallel workers of this process still running (a leak if any after a command)."""
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("bytediet-tp-rank")]


def test_cli_tensor_parallel_single_stream_prints_one_object(ckpt, fake_machine_2, capsys):
    assert bench(ckpt, "--threads", "2", "--parts", "single", "--peers", "none", "-tp", "2", "--json") == 0
    out = capsys.readouterr().out
    obj = json.loads(out)
    assert out.strip().count("\n") == 0 and obj["tensor_parallel_size"] == 2
    info = obj["systems"]["bytediet"]["info"]
    assert info["tensor_parallel_size"] == 2 and info["threads_per_rank"] == 1  # --threads 2 // 2
    assert info["kernels"]["decode_step"].startswith("modules (tensor parallel")
    assert info["weight_bytes"] == sum(info["weight_bytes_per_rank"]) and len(info["weight_bytes_per_rank"]) == 2
    assert obj["systems"]["bytediet"]["single"]["decode_tokens"] == BenchConfig.quick().decode_new_tokens
    assert "--tensor-parallel-size 2" in obj["command"] and "link" not in obj  # no roofline part: no link needed
    assert not tp_ranks_alive()


def test_cli_tensor_parallel_roofline_is_the_analyzer_at_tp2_over_the_measured_link(ckpt, fake_machine_2, capsys):
    from dataclasses import replace

    from bytediet.models.loader import load_config

    assert (
        bench(
            ckpt,
            "--threads",
            "2",
            "--parts",
            "roofline,context",
            "--peers",
            "none",
            "--roofline-batches",
            "2",
            "--contexts",
            "20",
            "-tp",
            "2",
            "--json",
        )
        == 0
    )
    obj = json.loads(capsys.readouterr().out)
    link = obj["link"]
    assert link["bus_bandwidth_gb_per_s"] == pytest.approx((4 << 20) / link["allreduce_s"] / 1e9)  # 2(N-1)/N = 1
    hop = link["hop_latency_us"] * 1e-6  # the small all-reduce less its bytes over the bus, per hop (2 at N = 2)
    assert hop == pytest.approx(max(0.0, link["small_allreduce_s"] - 4096 / (link["bus_bandwidth_gb_per_s"] * 1e9)) / 2)
    hw = replace(
        measure_mod.spec_from_measurement(FAKE_MACHINE),
        interconnect_bandwidth=2e9 * link["bus_bandwidth_gb_per_s"],
        interconnect_latency=hop,
    )
    config, c = load_config(str(ckpt)), obj["config"]
    row = obj["roofline"]["rows"][0]
    assert obj["roofline"]["tp"] == 2 and row["batch"] == 2 and row["linear_pass_s"] > 0
    pred = analyze(
        config,
        hw,
        weights=32.0,
        kv=32.0,
        batch=2,
        prompt_len=c["roofline_prompt_len"],
        context=c["roofline_prompt_len"] + 1 + c["roofline_steps"] // 2,
        tp=2,
    )
    assert row["predicted_tokens_per_s"] == pytest.approx(pred.decode_tokens_per_s)
    assert pred.decode.allreduce_s > 0
    assert obj["context_roofline"][0]["predicted_step_s"] == pytest.approx(
        analyze(config, hw, weights=32.0, kv=32.0, batch=1, prompt_len=20, context=20 - 4 // 2, tp=2).decode.time
    )
    assert not tp_ranks_alive()


def test_cli_tensor_parallel_refusals_and_shutdown_on_error(ckpt, fake_machine_2, capsys, monkeypatch):
    from bytediet.perf import bench as bench_mod
    from bytediet.quant import get_weight_format
    from bytediet.quant.base import WeightFormat

    with monkeypatch.context() as patch:  # a format without a shard method of its own (which formats split changes)
        patch.setattr(type(get_weight_format("int8")), "shard", WeightFormat.shard)
        for flags in (["--formats", "fp32,int8"], ["--weights", "int8"]):
            assert bench(ckpt, "--peers", "none", "-tp", "2", *flags) == 2
            assert (
                "int8: this weight format cannot be split for tensor parallelism (--tensor-parallel-size 2)"
                in capsys.readouterr().err
            )
    assert bench(ckpt, "-tp", "0") == 2

    def fail(system, ctx):
        raise ConfigError("a part failed")

    monkeypatch.setattr(bench_mod, "measure_single", fail)
    assert bench(ckpt, "--threads", "2", "--parts", "single", "--peers", "none", "-tp", "2") == 2
    assert "a part failed" in capsys.readouterr().err
    assert not tp_ranks_alive()  # the ranks were stopped on the way out


def test_prefix_cache_part_measures_cold_ram_and_disk_hits_with_equal_tokens(ckpt, fake_machine, capsys):
    assert bench(ckpt, *ALONE, "--parts", "prefix-cache", "--json") == 0
    r = json.loads(capsys.readouterr().out)["prefix_cache"]
    rp = r["repeated_prompt"]
    assert rp["cold"]["cached_tokens"] == {"pool": 0}
    assert rp["ram_hit"]["cached_tokens"].get("ram", 0) > 0 and rp["disk_hit"]["cached_tokens"].get("disk", 0) > 0
    assert all(rp[k]["tokens_equal_cold"] for k in ("ram_hit", "disk_hit"))
    ch = r["multi_turn_chat"]
    assert ch["requests"] == 8 and ch["tiers_on"]["ttft_p50_s"] > 0 and ch["tiers_off"]["output_tokens_per_s"] > 0
    assert bench(ckpt, *ALONE, "--parts", "prefix-cache") == 0
    assert "KV tiers" in capsys.readouterr().out
