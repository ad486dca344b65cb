"""``bytediet eval --kv-pareto``: every entry against bf16 KV on the same windows, the frontier, the clipped plot."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bytediet.eval import longctx
from bytediet.eval.corpus import tokenize_corpus
from bytediet.eval.kv_pareto import clip_limit, kv_pareto, off_scale, pareto_front, plot_kv_pareto
from bytediet.models.loader import load_model
from tests.conftest import model_from_state, random_state, tiny_config
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture(scope="module")
def tiny(ckpt):
    _, tokenizer = load_model(str(ckpt))
    cfg = tiny_config(
        "llama",
        vocab_size=tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 300,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    return model_from_state(cfg, random_state(cfg, seed=5)), tokenizer


@pytest.fixture(scope="module")
def result(ckpt, tiny):
    return kv_pareto(
        *tiny,
        corpus=str(ckpt / "corpus.txt"),
        windows=2,
        window_len=48,
        anchors=("q8_0", "k=q8_0,v=q4_0", "q4_0"),
        ours=("bf16", "turboquant2"),
        budgets=(6.0, 0.5),
        calib_windows=1,
        calib_len=64,
        passkey_lengths=(1024, 240),
        passkey_depths=(0.5,),
        passkey_trials=1,
    )


def test_every_entry_is_measured_against_bf16(result):
    recs = {r["spec"]: r for r in result["records"]}
    assert recs["bf16"]["ppl_change_pct"] == 0 and recs["bf16"]["kl_mean"] == pytest.approx(0, abs=1e-9)
    assert recs["q8_0"]["bits_per_coordinate"] == 8.5 and recs["k=q8_0,v=q4_0"]["bits_per_coordinate"] == 6.5
    assert recs["q8_0"]["bytes_per_token"] == 8.5 / 8 * 2 * 2 * 32 * 2  # 2 KV heads × 32 × 2 layers
    assert recs["turboquant2"]["kl_mean"] > recs["q8_0"]["kl_mean"] > 0
    assert recs["q8_0"]["kl_p99"] >= recs["q8_0"]["kl_mean"]
    # capacity in the KV memory of 16 bf16 sequences of 4096 tokens (512 B/token: 2 layers × 2 heads × 32 × 2 × 2 B)
    # = 33 554 432 B; q8_0: 272 B/token, 16-token blocks of 4352 B → 7710 blocks, 256 per sequence → 30
    assert result["settings"]["capacity_memory"] == 512 * 4096 * 16
    assert result["reference"]["capacity"]["sequences"] == 16
    assert recs["q8_0"]["capacity"] == {"sequences": 30, "num_blocks": 7710, "by_blocks": 30, "by_staging": None}
    assert recs["auto:6"]["bits_per_coordinate"] <= 6 and len(recs["auto:6"]["plan"]) == 2
    assert "auto:0.5 is below what any codec reaches" in recs["auto:0.5"]["error"]  # listed, named


def test_passkey_is_counted_per_length_and_lengths_beyond_the_context_are_noted(result):
    assert result["settings"]["passkey_lengths"] == [240]
    assert result["notes"] == ["passkey at 1024 tokens skipped: beyond the model's context (512 tokens)"]
    rows = [result["reference"]] + [r for r in result["records"] if "error" not in r]
    for r in rows:
        assert [(p["length"], p["trials"]) for p in r["passkey"]] == [(240, 1)]
        assert r["passkey"][0]["retrieved"] in (0, 1)


def test_passkey_retrieved_counts_the_successes(ckpt, tiny, monkeypatch):
    """An oracle in place of the answer check (even keys succeed): the counts are exactly the even keys among the
    seeded prompts, for every entry and the bf16 row alike."""
    monkeypatch.setattr(longctx, "answer_contains", lambda text, key: int(key) % 2 == 0)
    model, tokenizer = tiny
    corpus = str(ckpt / "corpus.txt")
    out = kv_pareto(
        model,
        tokenizer,
        corpus=corpus,
        windows=1,
        window_len=32,
        anchors=("q8_0",),
        ours=(),
        budgets=(),
        passkey_lengths=(230, 300),
        passkey_depths=(0.5,),
        passkey_trials=5,
        seed=3,
    )
    prompts = longctx.make_trials(tokenizer, tokenize_corpus(tokenizer, corpus), [230, 300], [0.5], 5, seed=3)
    expected = [
        {"length": n, "retrieved": sum(int(p.key) % 2 == 0 for p in prompts if p.length == n), "trials": 5}
        for n in (230, 300)
    ]
    assert out["reference"]["passkey"] == out["records"][0]["passkey"] == expected
    assert 0 < sum(e["retrieved"] for e in expected) < 10


def test_the_frontier_is_exactly_the_undominated_entries(result):
    ok = [r for r in result["records"] if "error" not in r]
    for r in ok:
        dominated = any(
            o["bytes_per_token"] <= r["bytes_per_token"]
            and o["ppl_change_pct"] < r["ppl_change_pct"]
            or o["bytes_per_token"] < r["bytes_per_token"]
            and o["ppl_change_pct"] <= r["ppl_change_pct"]
            for o in ok
        )
        assert r.get("frontier", False) == (not dominated), r["spec"]
    assert result["frontier"] == [
        r["spec"] for r in sorted(ok, key=lambda r: r["bytes_per_token"]) if r.get("frontier")
    ]
    assert pareto_front([(1, 5), (2, 3), (3, 4), (4, 1)]) == [0, 1, 3]


def test_a_head_dim_a_codec_cannot_take_is_listed_with_the_layer(ckpt):
    model, tokenizer = load_model(str(ckpt))  # head_dim 8
    out = kv_pareto(
        model,
        tokenizer,
        corpus=str(ckpt / "corpus.txt"),
        windows=1,
        window_len=32,
        anchors=("q8_0",),
        ours=("bf16",),
        budgets=(),
    )
    err = {r["spec"]: r.get("error") for r in out["records"]}
    assert "layer 0 has head_dim 8" in err["q8_0"] and err["bf16"] is None


def test_the_plot_clips_and_lists_off_scale_points(tmp_path, result):
    fake = json.loads(json.dumps(result))
    fake["records"].append(
        {
            "spec": "broken",
            "kind": "bytediet",
            "bytes_per_token": 100.0,
            "ppl_change_pct": 3884.0,
            "bits_per_coordinate": 1.0,
        }
    )
    assert clip_limit([0.1, 0.5, 1.0, 3884.0]) == 5.0 and clip_limit([10, 20, 30]) == 60
    top = clip_limit([r["ppl_change_pct"] for r in fake["records"] if "error" not in r])
    assert off_scale([r for r in fake["records"] if "error" not in r], top)[-1] == "broken: +3884.0 %"
    path = plot_kv_pareto(fake, tmp_path / "kv_pareto.png")
    assert path.stat().st_size > 10_000


def test_codecs_with_calibration_hooks_run_calibrated_and_say_on_what(result):
    recs = {r["spec"]: r for r in result["records"]}
    assert (
        recs["turboquant2"]["calibrated"] == "1 × 64 tokens of " + result["settings"]["corpus"] + "'s calibration split"
        and "calibrated" in recs["turboquant2"]["codec"]
    )
    assert "uncalibrated" not in recs["turboquant2"]["codec"]
    assert recs["q8_0"]["calibrated"] is None and recs["bf16"]["calibrated"] is None  # no hooks
    assert recs["auto:6"]["calibrated"] and recs["auto:6"]["validation"].startswith("validation mean KL")


def test_rows_equal_a_direct_computation_with_the_reference_on_disk_in_chunks(ckpt, tiny, monkeypatch):
    """The bf16 logits spilled to disk (``reference_memory=0``) and compared 64-row chunk by chunk: every row's
    perplexity change, KL mean and p99 and top-1 agreement equal those of whole windows' logits held in RAM."""
    from bytediet.eval import harness, tasks
    from bytediet.eval.corpus import make_windows
    from bytediet.eval.fidelity import kl_per_position, token_nll, top1_match
    from bytediet.kvcache import get_kv_codec

    monkeypatch.setattr(tasks, "ROW_CHUNK_ELEMENTS", 1)  # the 64-row minimum: 3 chunks of a 199-row window
    reads, rows = [], harness.ReferenceCache.rows

    def spy(self, index, lo, hi):
        reads.append((hi - lo, index in self._disk))
        return rows(self, index, lo, hi)

    monkeypatch.setattr(harness.ReferenceCache, "rows", spy)
    model, tokenizer = tiny
    corpus = str(ckpt / "corpus.txt")
    specs = ("q8_0", "q4_0", "bf16")
    out = kv_pareto(
        model,
        tokenizer,
        corpus=corpus,
        windows=2,
        window_len=200,
        anchors=specs[:2],
        ours=specs[2:],
        budgets=(),
        passkey_lengths=(),
        reference_memory=0,
    )
    assert len(reads) == 3 * 2 * 3 and all(on_disk and 64 <= n < 128 for n, on_disk in reads)

    wins = make_windows(tokenize_corpus(tokenizer, corpus), 200, 2, split="eval", seed=0)
    bos = torch.tensor(tokenizer.encode("", add_special_tokens=True), dtype=torch.long)

    def logits(spec):  # whole windows in RAM, as the Pareto report computed them before
        codec = get_kv_codec(spec)
        return [model.score(torch.cat([bos, w.ids]), kv_codec=codec)[len(bos) : -1] for w in wins]

    targets = [w.ids[1:] for w in wins]
    ref = logits("bf16")
    nll_ref = sum(float(token_nll(z, t).sum()) for z, t in zip(ref, targets))
    n = sum(len(t) for t in targets)
    assert out["reference"]["tokens"] == n and out["reference"]["ppl"] == pytest.approx(math.exp(nll_ref / n))
    recs = {r["spec"]: r for r in out["records"]}
    for spec in specs:
        test = logits(spec)
        nll = sum(float(token_nll(z, t).sum()) for z, t in zip(test, targets))
        kl = torch.cat([kl_per_position(r, z) for r, z in zip(ref, test)])
        top1 = float(torch.cat([top1_match(r, z) for r, z in zip(ref, test)]).double().mean())
        rec = recs[spec]
        assert rec["ppl_change_pct"] == pytest.approx(100 * (math.exp((nll - nll_ref) / n) - 1), abs=1e-6), spec
        assert rec["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-5, abs=1e-12), spec
        assert rec["kl_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)), rel=1e-5, abs=1e-12), spec
        assert rec["top1_agreement"] == top1, spec
    assert recs["q4_0"]["kl_mean"] > recs["q8_0"]["kl_mean"] > 0 == recs["bf16"]["kl_mean"]


def test_a_journal_resumes_a_stopped_run_and_refuses_another_runs(ckpt, tiny, tmp_path, monkeypatch):
    from bytediet.errors import ConfigError
    from bytediet.eval import kv_pareto as kp

    kw = dict(corpus=str(ckpt / "corpus.txt"), windows=1, window_len=48, calib_windows=1, calib_len=64)
    kw.update(passkey_lengths=(), anchors=("q8_0", "q4_0"), ours=("turboquant2",), budgets=(6.0,))
    journal = tmp_path / "q.jsonl"
    measured = []
    real = kp._measure
    monkeypatch.setattr(
        kp, "_measure", lambda model, codec, spec, *a: (measured.append(spec), real(model, codec, spec, *a))[1]
    )
    first = kv_pareto(*tiny, **{**kw, "ours": ()}, journal=journal)  # a run stopped before turboquant2
    assert measured == ["q8_0", "q4_0", "auto:6"]
    with open(journal, "a") as f:
        f.write('{"record": {"spec": "turbo')  # a line cut short by a kill
    measured.clear()
    again = kv_pareto(*tiny, **kw, journal=journal)
    assert measured == ["turboquant2"]  # the rest came from the journal
    assert [r["spec"] for r in again["records"]] == ["q8_0", "q4_0", "turboquant2", "auto:6"]
    old = {r["spec"]: r for r in first["records"]}
    for r in again["records"][:2]:
        assert r["ppl_change_pct"] == old[r["spec"]]["ppl_change_pct"] and r["kl_mean"] == old[r["spec"]]["kl_mean"]
    assert any("resumed from" in n for n in again["notes"])
    with pytest.raises(ConfigError, match="holds another run"):
        kv_pareto(*tiny, **{**kw, "window_len": 40}, journal=journal)
